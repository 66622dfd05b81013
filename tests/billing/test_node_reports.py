"""POST /api/v1/nodes/usage: node credential only, stored once per (node, boot_id, sequence), entries for caches
not placed on the node refused and audited, late reports ignored, bad bodies 400 with codes."""

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from rest_framework.test import APIClient

from audit.actions import AuditAction
from audit.models import AuditEvent
from billing.models import UsageReport, UsageSample
from tests.billing.conftest import GB, entry

pytestmark = pytest.mark.django_db
URL = "/api/v1/nodes/usage"


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code, response.content
    return response.json()["error"]


def test_a_report_lands_as_one_sample_per_cache(reporting_node, make_tenant, make_cache):
    tenant = make_tenant().tenant
    first, second = make_cache(tenant, reporting_node.node), make_cache(tenant, reporting_node.node)
    at = _now() - timedelta(minutes=5)
    answer = reporting_node.report(at, [entry(first, device=2 * GB, written=10, served=3), entry(second, dram=5)])
    assert answer == {"duplicate": False, "late": False, "accepted": 2, "refused": []}
    samples = {s.cache_id: s for s in UsageSample.objects.all()}
    assert set(samples) == {first.pk, second.pk}
    one = samples[first.pk]
    assert (one.device_bytes, one.bytes_written_total, one.tokens_served_total, one.tenant_id) == (
        2 * GB,
        10,
        3,
        tenant.pk,
    )
    assert (one.node_id, str(one.boot_id), one.sequence, one.sampled_at) == (
        reporting_node.node.pk,
        reporting_node.boot_id,
        1,
        at,
    )


def test_a_duplicate_answers_duplicate_and_changes_nothing(reporting_node, make_tenant, make_cache):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    body = reporting_node.body(_now(), [entry(cache, device=GB)])
    assert reporting_node.post(body).json()["duplicate"] is False
    changed = dict(body, caches=[entry(cache, device=7 * GB)])  # same idempotency id, other values
    again = reporting_node.post(changed)
    assert again.status_code == 200 and again.json() == {"duplicate": True, "late": False, "accepted": 0, "refused": []}
    assert list(UsageSample.objects.values_list("device_bytes", flat=True)) == [GB]
    assert UsageReport.objects.count() == 1


def test_the_same_sequence_of_another_boot_or_node_is_another_report(make_reporting_node, make_tenant, make_cache):
    node, other = make_reporting_node(), make_reporting_node()
    tenant = make_tenant().tenant
    mine, theirs = make_cache(tenant, node.node), make_cache(tenant, other.node)
    node.report(_now(), [entry(mine, device=1)], sequence=1)
    node.report(_now(), [entry(mine, device=2)], sequence=1, boot_id=str(uuid.uuid4()))
    other.report(_now(), [entry(theirs, device=3)], sequence=1, boot_id=node.boot_id)
    assert sorted(UsageSample.objects.values_list("device_bytes", flat=True)) == [1, 2, 3]


def test_entries_for_caches_not_placed_on_the_node_are_refused_and_audited(
    make_reporting_node, make_tenant, make_cache
):
    node, elsewhere = make_reporting_node(), make_reporting_node()
    tenant = make_tenant().tenant
    mine, foreign, unknown = make_cache(tenant, node.node), make_cache(tenant, elsewhere.node), uuid.uuid4()
    before = AuditEvent.objects.count()
    answer = node.report(
        _now(), [entry(mine, device=1), entry(foreign, device=2), {**entry(mine), "cache_id": str(unknown)}]
    )
    assert answer["accepted"] == 1
    assert sorted(r["cache_id"] for r in answer["refused"]) == sorted([str(foreign.pk), str(unknown)])
    assert {r["reason"] for r in answer["refused"]} == {"not_placed_on_node"}
    assert list(UsageSample.objects.values_list("cache_id", flat=True)) == [mine.pk]
    events = AuditEvent.objects.filter(action=AuditAction.USAGE_REPORT_REFUSED)
    assert AuditEvent.objects.count() == before + 1 and events.count() == 1
    event = events.get()
    assert (event.actor_kind, event.actor_id, event.target_type, event.target_id) == (
        "node",
        str(node.node.pk),
        "node",
        str(node.node.pk),
    )
    assert sorted(event.new_values["refused_cache_ids"]) == sorted([str(foreign.pk), str(unknown)])


def test_a_fully_accepted_report_writes_no_audit_event(reporting_node, make_tenant, make_cache):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    before = AuditEvent.objects.count()
    reporting_node.report(_now(), [entry(cache, device=1)])
    assert AuditEvent.objects.count() == before


def test_a_report_sampled_before_the_grace_window_is_ignored(reporting_node, make_tenant, make_cache, settings):
    settings.KCAAS_USAGE_GRACE_SECONDS = 3600
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    answer = reporting_node.report(_now() - timedelta(seconds=3700), [entry(cache, device=GB)])
    assert answer == {"duplicate": False, "late": True, "accepted": 0, "refused": []}
    assert not UsageSample.objects.exists() and not UsageReport.objects.exists()
    assert reporting_node.report(_now() - timedelta(seconds=3500), [entry(cache, device=GB)])["accepted"] == 1


def test_a_time_ahead_of_the_control_plane_beyond_the_skew_is_400(reporting_node, make_tenant, make_cache):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    response = reporting_node.post(reporting_node.body(_now() + timedelta(hours=1), [entry(cache, device=1)]))
    _error(response, 400, "invalid_usage_report")
    assert not UsageSample.objects.exists()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"sequence": 0}, "sequence"),
        ({"boot_id": "not-a-uuid"}, "boot_id"),
        ({"sampled_at": "yesterday"}, "sampled_at"),
        (
            {
                "caches": [
                    {
                        "cache_id": str(uuid.uuid4()),
                        "device_bytes": -1,
                        "dram_bytes": 0,
                        "ssd_bytes": 0,
                        "bytes_written_total": 0,
                        "tokens_served_total": 0,
                    }
                ]
            },
            "caches",
        ),
        ({"caches": [{"cache_id": str(uuid.uuid4()), "device_bytes": 2**63}]}, "caches"),
        ({"caches": "all"}, "caches"),
    ],
)
def test_invalid_bodies_are_400_validation_error_naming_the_field(reporting_node, change, field):
    body = {**reporting_node.body(_now(), []), **change}
    error = _error(reporting_node.post(body), 400, "validation_error")
    assert field in error["details"]["fields"]


def test_a_cache_listed_twice_is_400(reporting_node, make_tenant, make_cache):
    cache = make_cache(make_tenant().tenant, reporting_node.node)
    body = reporting_node.body(_now(), [entry(cache, device=1), entry(cache, device=2)])
    _error(reporting_node.post(body), 400, "validation_error")


def test_the_entries_of_one_report_are_bounded(reporting_node):
    many = [
        {
            "cache_id": str(uuid.uuid4()),
            "device_bytes": 0,
            "dram_bytes": 0,
            "ssd_bytes": 0,
            "bytes_written_total": 0,
            "tokens_served_total": 0,
        }
        for _ in range(10_001)
    ]
    _error(reporting_node.post(reporting_node.body(_now(), many)), 400, "validation_error")


def test_only_a_node_credential_may_report(reporting_node, tenant_a, staff_client):
    body = reporting_node.body(_now(), [])
    _error(APIClient().post(URL, body, format="json"), 401, "not_authenticated")
    _error(tenant_a.client.post(URL, body, format="json"), 401, "not_authenticated")
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION=f"Bearer {reporting_node.credential[:-4]}AAAA")
    assert forged.post(URL, body, format="json").status_code == 401
    assert staff_client.post(URL, body, format="json").status_code in (401, 403)
