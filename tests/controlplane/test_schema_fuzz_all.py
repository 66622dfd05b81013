"""Schemathesis over the WHOLE published schema with a valid tenant key (every scope), in process.

Every operation — the tenant's own, the staff-only admin ones and the node-only ones — gets schema-valid and
schema-invalid requests: no response may be a 5xx or differ from the schema, and invalid requests must be refused.
The per-room runs (tests/*/test_schema_fuzz.py) go deeper with the principal each room serves (staff, nodes).
Checks left out, and why:
- positive_data_acceptance for caches_attach: whether a capacity holds one block depends on the spec beside it, a
  rule across fields that JSON Schema cannot state; for admin and node operations a tenant key is rightly refused
  (401/403) whatever the data;
- use_after_free: a detached cache stays readable (its final state) by design.
"""

import os
import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance, use_after_free

from fleet import services as fleet_services
from tenants import scopes
from tenants import services as tenant_services

MAX_EXAMPLES = int(os.environ.get("KCAAS_FUZZ_EXAMPLES", "8"))
TIER_LIMIT = 2**50
TENANT_OWN = ("keys", "caches", "whoami", "jwks")


@pytest.fixture
def tenant_key(db) -> str:
    issued = fleet_services.node_create(name=f"fuzz-node-{uuid.uuid4().hex[:6]}")
    fleet_services.node_register(
        node_id=issued.node.pk,
        endpoint="10.9.0.1:7000",
        capacity={"device": TIER_LIMIT, "dram": TIER_LIMIT, "ssd": TIER_LIMIT},
    )
    tenant = tenant_services.tenant_create(name=f"fuzz-{uuid.uuid4().hex[:6]}")
    tenant_services.quota_update(
        tenant=tenant,
        max_requests_per_second=100_000,
        max_device_bytes=TIER_LIMIT,
        max_dram_bytes=TIER_LIMIT,
        max_ssd_bytes=TIER_LIMIT,
    )
    return tenant_services.api_key_issue(tenant=tenant, scopes=list(scopes.ALL_SCOPES)).raw_key


def test_every_operation_conforms_to_the_schema_for_a_tenant_key(wsgi_app, tenant_key):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20  # tenants, fleet (node + admin) and caches operations are all published
    headers = {"Authorization": f"Bearer {tenant_key}"}
    for operation in operations:
        operation_id = operation.definition.raw["operationId"]
        tenant_own = operation_id.startswith(TENANT_OWN) and operation_id != "caches_attach"
        excluded = [use_after_free] + ([] if tenant_own else [positive_data_acceptance])
        modes = [(GenerationMode.POSITIVE, MAX_EXAMPLES), (GenerationMode.NEGATIVE, MAX_EXAMPLES // 2)]
        raw = operation.definition.raw
        if not raw.get("parameters") and not raw.get("requestBody"):
            modes = modes[:1]  # nothing to send wrong
        for mode, examples in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(headers=headers, excluded_checks=excluded)

            try:
                check()
            except Exception as error:
                raise AssertionError(f"{operation_id} ({mode.value}): {error}") from error
