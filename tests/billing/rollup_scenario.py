"""One billing scenario through the real services, run in the test process (PostgreSQL) or in a manage.py shell on
SQLite (tests/billing/test_rollup_sqlite.py): `python manage.py shell -c "from tests.billing.rollup_scenario import
main; main('setup')"` prints its result as one JSON line.

With KCAAS_USAGE_GRACE_SECONDS=600: a cache placed on a node, a report two hours old (recorded back then: the
counter baseline of the open hours) and three in the open hours, 60 s apart, 1000 device bytes each. The rollup
then holds 300 000 device byte-seconds (60 + 60 + the last sample's 180 s max gap), 30 tokens served and 60 bytes
written (the counters' growth over the baseline)."""

from __future__ import annotations

import json
import sys
import uuid
from datetime import timedelta

EXPECTED_TOTALS = {"device": 300_000, "tokens": 30, "written": 60}
SPEC = {
    "model_fingerprint": "tiny@1",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_size": 16,
    "kv_dtype": "float16",
    "storage_dtype": "float16",
}


def _report(ids: dict, sequence: int, sampled_at, tokens: int, device: int = 1000, received_at=None) -> None:
    from billing import services as billing

    entry = {
        "cache_id": uuid.UUID(ids["cache"]),
        "device_bytes": device,
        "dram_bytes": 0,
        "ssd_bytes": 0,
        "bytes_written_total": 2 * tokens,
        "tokens_served_total": tokens,
    }
    outcome = billing.usage_report_record(
        node_id=uuid.UUID(ids["node"]),
        boot_id=uuid.UUID(ids["boot"]),
        sequence=sequence,
        sampled_at=sampled_at,
        entries=[entry],
        now=received_at or sampled_at,
    )
    assert outcome.accepted == 1, outcome


def setup() -> dict:
    """The tenant, node and cache (caches.services places it), and the four reports; returns their ids."""
    from django.utils import timezone

    from caches import services as caches
    from fleet import services as fleet
    from kcaas.spec import KVCacheSpec
    from tenants import services as tenants

    tenant = tenants.tenant_create(name="rollup-scenario")
    node = fleet.node_create(name="rollup-node").node
    fleet.node_register(node_id=node.pk, endpoint="127.0.0.1:9", capacity={"device": 1 << 30, "dram": 0, "ssd": 0})
    cache = caches.cache_attach(
        tenant_id=tenant.pk, name="billed", spec=KVCacheSpec(**SPEC), capacity={"device": 1 << 20, "dram": 0, "ssd": 0}
    )
    assert cache.node_id == node.pk
    ids = {"cache": str(cache.pk), "node": str(node.pk), "boot": str(uuid.uuid4())}
    now = timezone.now().replace(microsecond=0)
    _report(ids, 1, now - timedelta(hours=2), 100)
    for i, tokens in enumerate((110, 120, 130)):
        _report(ids, 2 + i, now - timedelta(seconds=300 - 60 * i), tokens, received_at=now)
    return ids


def rollups(times: int) -> dict:
    """The `billing.rollup` task body `times` times; the rows each wrote and the ledger's totals."""
    from django.db.models import Sum

    from billing.models import LedgerHour
    from billing.tasks import rollup

    written = [rollup() for _ in range(times)]
    totals = LedgerHour.objects.aggregate(
        device=Sum("device_byte_seconds"), tokens=Sum("tokens_served"), written=Sum("bytes_written")
    )
    return {"written": written, "totals": totals, "rows": LedgerHour.objects.count()}


def more_reports(ids: dict) -> dict:
    """20 more reports (each its own transaction) of an emptied cache whose counters restarted: they add no tokens."""
    from django.utils import timezone

    start = timezone.now().replace(microsecond=0) - timedelta(seconds=100)
    for i in range(20):
        _report(ids, 100 + i, start + timedelta(seconds=i), 0, device=0)
    return {"reports": 20}


def main(step: str, *args: str) -> None:
    steps = {
        "setup": setup,
        "rollups": lambda times: rollups(int(times)),
        "more_reports": lambda ids: more_reports(json.loads(ids)),
    }
    print(json.dumps(steps[step](*args)))
    sys.stdout.flush()
