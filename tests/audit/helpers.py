"""Shared test helpers of the audit tests: record events, sign digests, export, re-encode tampered records."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

from django.db import transaction

from audit import chain
from audit.actions import AuditAction
from audit.context import Actor, acting_as
from audit.services import audit_record

EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def record(tenant_id=None, *, action=AuditAction.QUOTA_UPDATED, actor=Actor("key", "k1"), new=None):
    with transaction.atomic(), acting_as(actor):
        return audit_record(
            action=action,
            target_type="tenant",
            target_id=tenant_id or "",
            tenant_id=tenant_id,
            new=new if new is not None else {"max_caches": 3},
        )


def next_second() -> None:
    """Sleep into the next whole second (1-second digest periods in these tests)."""
    time.sleep(1.02 - (time.time() % 1))


def far_future() -> datetime:
    return datetime.now(UTC) + timedelta(days=1)


def read_records(path) -> list[dict]:
    """The records of a JSONL export."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def encode(records: list[dict], fmt: str) -> list[str]:
    """Records as the lines of an export in `fmt` (what a tamperer who knows the format would write)."""
    if fmt == "jsonl":
        return [chain.canonical(r).decode() + "\n" for r in records]
    from audit.exports import _csv_line

    return [_csv_line(chain.CSV_COLUMNS)] + [_csv_line(chain.csv_row(r)) for r in records]


def first_problem(report) -> tuple[str, int | None]:
    assert not report.ok, report.summary()
    return report.problems[0].code, report.problems[0].seq
