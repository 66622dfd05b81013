"""The chain head is the last lock a transaction takes, even though PostgreSQL checks foreign keys at COMMIT:
audit_record runs the deferred checks first (SET CONSTRAINTS ALL IMMEDIATE). Without that, issuing a data token
(which inserts a row referencing its cache, then records its event) while another transaction holds that cache row
and waits for the head (a cutover) deadlocked, and one of them answered 500 (seen in the e2e drain test)."""

import threading

import pytest
from django.db import connection, connections, transaction

from audit.actions import AuditAction
from audit.services import audit_record
from caches import services
from caches.models import Cache
from tests.caches.conftest import (  # noqa: F401 - fixtures
    attach_body,
    make_node,
    make_ready,
    make_tenant,
    node,
    tenant_a,
)
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_token_issue_and_a_transaction_holding_its_cache_both_commit(tenant_a, node):
    response = tenant_a.client.post("/api/v1/caches", attach_body("locked"), format="json")
    cache = make_ready(response.json()["id"])
    holding, results = threading.Event(), {}

    def waited_for() -> bool:
        """Whether another transaction (the token issue's) is blocked on a lock this one holds."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))")
            return cursor.fetchone()[0] > 0

    def hold_the_cache_then_record():
        try:
            with transaction.atomic():
                Cache.objects.select_for_update().get(pk=cache.pk)  # as a cutover does
                holding.set()
                # the token issue runs meanwhile, up to where it needs this row: then it waits for this transaction
                assert eventually(lambda: "issuer" in results or waited_for()) and "issuer" not in results, (
                    "the token issue never waited for the held cache row"
                )
                audit_record(
                    action=AuditAction.CACHE_MIGRATED,
                    target_type="cache",
                    target_id=cache.pk,
                    tenant_id=cache.tenant_id,
                )
            results["holder"] = "committed"
        except Exception as error:  # noqa: BLE001 - the outcome under test
            results["holder"] = error
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_cache_then_record)
    holder.start()
    assert holding.wait(5)
    try:
        services.data_token_issue(tenant_id=tenant_a.tenant.pk, cache_id=cache.pk, access="read")
        results["issuer"] = "committed"
    except Exception as error:  # noqa: BLE001
        results["issuer"] = error
    holder.join(10)
    assert results == {"holder": "committed", "issuer": "committed"}
