"""Schemathesis over the billing operations, each with the principal it serves (tenant key, staff, node
credential), in process: no 5xx, every answer as the schema says, schema-invalid requests refused."""

import base64
import os
import uuid
from datetime import UTC, datetime

import pytest
import schemathesis
from django.contrib.auth import get_user_model
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from billing.models import LedgerHour
from tests.billing.conftest import GB
from tests.caches.conftest import PASSWORD

BILLING_PATHS = r"^/api/v1/(usage|invoices|admin/rates|nodes/usage)"
MAX_EXAMPLES = int(os.environ.get("KCAAS_FUZZ_EXAMPLES", "10"))
pytestmark = pytest.mark.django_db


@pytest.fixture
def principals(make_tenant, make_cache, reporting_node, fast_password_hasher):
    tenant = make_tenant(scopes=("usage:write", "caches:read"))
    cache = make_cache(tenant.tenant, reporting_node.node)
    LedgerHour.objects.create(
        cache=cache,
        tenant=tenant.tenant,
        hour=datetime(2026, 3, 1, tzinfo=UTC),
        device_byte_seconds=7 * GB * 1800,
        ssd_byte_seconds=5,
    )
    user = get_user_model().objects.create_user(f"ops-{uuid.uuid4().hex[:6]}", password=PASSWORD, is_staff=True)
    staff = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    return {
        "tenant": f"Bearer {tenant.raw_key}",
        "staff": f"Basic {staff}",
        "node": f"Bearer {reporting_node.credential}",
    }


def _principal(operation_id: str) -> str:
    if operation_id.startswith("admin_"):
        return "staff"
    return "node" if operation_id == "nodes_usage" else "tenant"


def test_billing_endpoints_conform_to_the_schema(wsgi_app, principals):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app).include(path_regex=BILLING_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.definition.raw["operationId"] for op in operations) == [
        "admin_rates_create",
        "admin_rates_list",
        "invoices_list",
        "invoices_retrieve",
        "nodes_usage",
        "usage_retrieve",
    ]
    for operation in operations:
        operation_id = operation.definition.raw["operationId"]
        headers = {"Authorization": principals[_principal(operation_id)]}
        # rules JSON Schema cannot state: a rate's effective_from is a whole hour; a report's sampled_at is not ahead
        # of the control plane's clock; a usage series needs from and to together, from before to, a bounded span
        time_rules = operation_id in ("admin_rates_create", "nodes_usage", "usage_retrieve")
        excluded = [positive_data_acceptance] if time_rules else []
        for mode, examples in ((GenerationMode.POSITIVE, MAX_EXAMPLES), (GenerationMode.NEGATIVE, MAX_EXAMPLES // 2)):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(headers=headers, excluded_checks=excluded)

            try:
                check()
            except Exception as error:
                raise AssertionError(f"{operation_id} ({mode.value}): {error}") from error


def test_a_usage_answer_with_its_series_and_as_csv_conforms(wsgi_app, principals):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app)
    operation = schema["/api/v1/usage"]["GET"]
    headers = {"Authorization": principals["tenant"]}
    period = {"from": "2026-03-01T00:00:00Z", "to": "2026-03-02T00:00:00Z", "granularity": "hour"}
    response = operation.Case(query=period).call_and_validate(headers=headers)
    assert response.json()["series"]["buckets"][0]["device_gb_hours"] == "3.5"
    csv_answer = operation.Case(query={**period, "format": "csv"}).call_and_validate(headers=headers)
    assert csv_answer.text.splitlines()[1].startswith("2026-03-01T00:00:00+00:00,12600000000000,0,5,3.5,")
