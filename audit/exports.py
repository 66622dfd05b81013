"""Audit exports (JSONL, CSV) that verify offline with audit/chain.py alone.

An export of a time range [start, end) (and optionally one tenant) is a header, the chain segment [lo, hi] in seq
order, then the digests anchoring it (audit.chain documents the record layouts and the CSV columns):
- the segment holds every event that occurred in the range, as an `event` record when it matches the tenant filter
  and as a `witness` (seq, prev_hash, hash: no personal data) otherwise, so the chain's continuity still checks;
- it is stretched with witnesses back to the head of the last digest before the range (its `anchor`, so the first
  record's prev_hash is a signed hash) and forward to the head of the first digest at or after the range's last
  event (so the last record is signed too); the digests from the anchor to that one are included, contiguous;
- the header states the format and version, the range, the filter, the segment's first/last seq, the record
  counts, the platform's public key (JWK) and the digest period;
- a last `signature` record signs every record before it with the platform key (so what no chain hash covers, the
  action names, pseudonymised fields and the header, verifies too).
The segment is fixed before the first line is written (the chain is append-only), so an export streams in chunks
and never includes events appended while it streams.

`audit_export_begin` is the one way an export is served (the REST API and the console both call it, then
`export_response`): it validates the range, fixes the plan, then records AUDIT_EXPORTED in its own transaction, so
every export that is served has been recorded and the export never holds its own event.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

from django.db import transaction
from django.db.models import Max, Min
from django.http import StreamingHttpResponse
from django.utils import timezone

from audit import chain
from audit.actions import AuditAction
from audit.digests import period_seconds
from audit.keys import platform_public_jwk, platform_sign
from audit.models import AuditDigest, AuditEvent
from audit.services import audit_record
from core.errors import ApplicationError

FORMATS = {"jsonl": "application/x-ndjson", "csv": "text/csv"}
CHUNK = 1000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # an export's default start


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What an export holds: the range and filter, the chain segment [lo, hi] (None when the range is empty), the
    digests' period_start bounds and the record counts."""

    start: datetime
    end: datetime
    tenant_id: uuid.UUID | None
    lo: int | None
    hi: int | None
    digests: tuple[AuditDigest, ...]
    events: int

    @property
    def witnesses(self) -> int:
        return 0 if self.lo is None else self.hi - self.lo + 1 - self.events


def export_plan(*, start: datetime, end: datetime, tenant_id: uuid.UUID | None = None) -> ExportPlan:
    in_range = AuditEvent.objects.filter(occurred_at__gte=start, occurred_at__lt=end)
    bounds = in_range.aggregate(first=Min("seq"), last=Max("seq"))
    if bounds["first"] is None:
        digests = AuditDigest.objects.filter(period_end__gt=start, period_start__lt=end)
        return ExportPlan(start, end, tenant_id, None, None, tuple(digests.order_by("period_start")), 0)
    anchor = AuditDigest.objects.filter(head_seq__lt=bounds["first"]).order_by("-period_start").first()
    closing = AuditDigest.objects.filter(head_seq__gte=bounds["last"]).order_by("period_start").first()
    lo = anchor.head_seq + 1 if anchor else bounds["first"]
    hi = max(bounds["last"], closing.head_seq) if closing else bounds["last"]
    digests = AuditDigest.objects.all()
    if anchor:
        digests = digests.filter(period_start__gte=anchor.period_start)
    if closing:
        digests = digests.filter(period_start__lte=closing.period_start)
    else:
        digests = digests.filter(head_seq__gte=lo - 1)
    events = _matching(in_range.filter(seq__gte=lo, seq__lte=hi), tenant_id).count()
    return ExportPlan(start, end, tenant_id, lo, hi, tuple(digests.order_by("period_start")), events)


def _matching(events, tenant_id):
    return events if tenant_id is None else events.filter(tenant_id=tenant_id)


def header_record(plan: ExportPlan) -> dict:
    return {
        "record_type": "header",
        "format": chain.EXPORT_FORMAT,
        "version": chain.EXPORT_VERSION,
        "generated_at": timezone.now().isoformat(),
        "range": {"from": plan.start.isoformat(), "to": plan.end.isoformat()},
        "filter": {"tenant_id": str(plan.tenant_id) if plan.tenant_id else None},
        "first_seq": plan.lo,
        "last_seq": plan.hi,
        "counts": {"event": plan.events, "witness": plan.witnesses, "digest": len(plan.digests)},
        "platform_key": platform_public_jwk(),
        "digest_period_seconds": period_seconds(),  # a verifier says when the unsigned tail will be signed
    }


def event_record(event: AuditEvent) -> dict:
    """Every field a verifier needs, plus the action's name (not hashed: for readers)."""
    try:
        action_name = AuditAction(event.action).code_name
    except ValueError:
        action_name = "unknown"
    return {
        "record_type": "event",
        **event.chain_fields(),
        "action_name": action_name,
        "salt": bytes(event.salt).hex() if event.salt is not None else None,
        "commitments": event.commitments,
        "prev_hash": event.prev_hash,
        "hash": event.hash,
    }


def witness_record(event: AuditEvent) -> dict:
    return {"record_type": "witness", "seq": event.seq, "prev_hash": event.prev_hash, "hash": event.hash}


def export_records(plan: ExportPlan) -> Iterator[dict]:
    """The header, the segment's records in seq order, the digests, then the signature of all of them (the
    platform key over chain.records_hash: it covers what no chain hash does, the action names, the pseudonyms and
    the header)."""
    running = hashlib.sha256()
    for record in _chain_records(plan):
        running.update(chain.canonical(record) + b"\n")
        yield record
    key_id = platform_public_jwk()["kid"]
    body = chain.export_signature_body(records_hash=running.hexdigest(), key_id=key_id)
    _, signature = platform_sign(chain.canonical(body))
    yield {"record_type": "signature", "records_hash": body["records_hash"], "key_id": key_id, "signature": signature}


def _chain_records(plan: ExportPlan) -> Iterator[dict]:
    yield header_record(plan)
    if plan.lo is not None:
        for low in range(plan.lo, plan.hi + 1, CHUNK):
            chunk = AuditEvent.objects.filter(seq__gte=low, seq__lte=min(low + CHUNK - 1, plan.hi)).order_by("seq")
            for event in chunk:
                yield event_record(event) if _included(plan, event) else witness_record(event)
    for digest in plan.digests:
        yield {"record_type": "digest", **digest.record()}


def _included(plan: ExportPlan, event: AuditEvent) -> bool:
    in_range = plan.start <= event.occurred_at < plan.end
    return in_range and (plan.tenant_id is None or event.tenant_id == plan.tenant_id)


def export_lines(plan: ExportPlan, fmt: str) -> Iterator[str]:
    """The export as text lines in `fmt` (jsonl | csv)."""
    if fmt == "jsonl":
        for record in export_records(plan):
            yield chain.canonical(record).decode() + "\n"
        return
    if fmt != "csv":
        raise ValueError(f"unknown export format {fmt!r}")
    yield _csv_line(chain.CSV_COLUMNS)
    for record in export_records(plan):
        yield _csv_line(chain.csv_row(record))


def _csv_line(cells) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class ExportDownload:
    """An export that has been recorded (AUDIT_EXPORTED) and is ready to stream: its plan, format and file name."""

    plan: ExportPlan
    fmt: str

    @property
    def content_type(self) -> str:
        return FORMATS[self.fmt] + "; charset=utf-8"

    @property
    def filename(self) -> str:
        return f"kcaas-audit-{self.plan.end.strftime('%Y%m%dT%H%M%SZ')}.{self.fmt}"

    def lines(self) -> Iterator[str]:
        return export_lines(self.plan, self.fmt)


def audit_export_begin(
    *,
    fmt: str = "jsonl",
    start: datetime | None = None,
    end: datetime | None = None,
    tenant_id: uuid.UUID | None = None,
) -> ExportDownload:
    """Start an export of [start, end) (default: EPOCH until now), optionally confined to one tenant.

    Raises ApplicationError `invalid_range` unless start < end (nothing recorded then). The plan is fixed first,
    then AUDIT_EXPORTED (format, range, filter, segment) is committed in its own transaction by the current actor
    (audit.context), so the export never holds its own event and nothing streams unless it was recorded
    (AuditWriteError propagates)."""
    if fmt not in FORMATS:
        raise ApplicationError(f"Unknown export format {fmt!r}.", code="validation_error")
    start, end = start or EPOCH, end or timezone.now()
    if start >= end:
        raise ApplicationError("`from` must be before `to`.", code="invalid_range")
    plan = export_plan(start=start, end=end, tenant_id=tenant_id)
    with transaction.atomic():
        audit_record(
            action=AuditAction.AUDIT_EXPORTED,
            target_type="audit_export",
            tenant_id=tenant_id,
            new={
                "format": fmt,
                "from": start,
                "to": end,
                "tenant_id": tenant_id,
                "first_seq": plan.lo,
                "last_seq": plan.hi,
            },
        )
    return ExportDownload(plan, fmt)


def export_response(download: ExportDownload) -> StreamingHttpResponse:
    """The recorded export as a streamed attachment."""
    response = StreamingHttpResponse(download.lines(), content_type=download.content_type)
    response["Content-Disposition"] = f'attachment; filename="{download.filename}"'
    return response


def write_export(path, *, start: datetime, end: datetime, tenant_id=None, fmt: str = "jsonl") -> ExportPlan:
    """Write an export to a file (tests, operators); returns its plan."""
    plan = export_plan(start=start, end=end, tenant_id=tenant_id)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.writelines(export_lines(plan, fmt))
    return plan
