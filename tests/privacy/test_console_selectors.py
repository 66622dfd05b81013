"""The privacy room's read-side for the console's GDPR page: every job with its purge progress, tenant labels that
never show what an erasure removed, whether a stored receipt verifies, and a tenant named by name or id."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.services import tenant_pseudonym
from privacy import selectors, services
from privacy.models import ErasureJob

pytestmark = pytest.mark.django_db
PAST = timedelta(days=2)


def test_job_list_is_newest_first_with_nodes_to_purge_and_purged(make_tenant, make_node):
    older, newer = make_tenant().tenant, make_tenant().tenant
    nodes = [make_node(), make_node()]
    services.erasure_request(tenant_id=older.pk, requested_by="user:1", now=timezone.now() - PAST)
    services.erasures_run_due()  # the older one is past its grace: running, one purge per node
    job = ErasureJob.objects.get(tenant_id=older.pk)
    services.erasure_purge_confirmed(job_id=job.pk, node_id=nodes[0].pk, tenant_id=older.pk, purged=[])
    services.erasure_request(tenant_id=newer.pk, requested_by="user:1")
    listed = list(selectors.erasure_job_list())
    assert [j.tenant_id for j in listed] == [newer.pk, older.pk]
    assert [(j.state, j.nodes_to_purge, j.nodes_purged) for j in listed] == [("scheduled", 0, 0), ("running", 2, 1)]


def test_tenant_labels_are_names_and_pseudonyms_once_erased(make_tenant, no_grace):
    kept, erased = make_tenant().tenant, make_tenant().tenant
    original_name = erased.name
    services.erasure_request(tenant_id=erased.pk, requested_by="user:1")
    services.erasures_run_due()  # no node: started and completed in one pass
    gone = uuid.uuid4()  # a tenant whose row no longer exists
    labels = selectors.erasure_tenant_labels(tenant_ids=[kept.pk, str(erased.pk), gone, "not-a-uuid"])
    assert labels == {
        kept.pk: kept.name,
        erased.pk: f"erased-{tenant_pseudonym(erased.pk)}",
        gone: f"erased-{tenant_pseudonym(gone)}",
    }
    assert original_name not in labels.values()


def test_receipt_verifies_only_while_untouched(make_tenant, no_grace):
    tenant = make_tenant().tenant
    job, _ = services.erasure_request(tenant_id=tenant.pk, requested_by="user:1")
    assert selectors.erasure_receipt_verifies(job=job) is False  # no receipt yet
    services.erasures_run_due()
    job.refresh_from_db()
    assert job.state == "complete" and selectors.erasure_receipt_verifies(job=job) is True
    job.receipt = {**job.receipt, "bytes_freed": job.receipt["bytes_freed"] + 1}
    assert selectors.erasure_receipt_verifies(job=job) is False
    job.refresh_from_db()
    job.receipt_signature = "AAAA"
    assert selectors.erasure_receipt_verifies(job=job) is False
