"""Schemathesis over the caches endpoints of the published schema, in process: no 5xx, every response matches the
schema, schema-violating requests are refused. Positive generation for attach is checked without
`positive_data_acceptance`: whether a capacity holds one block depends on the spec next to it (a rule across fields
that JSON Schema cannot state), so a schema-valid attach may rightly be a 400 invalid_capacity.

The tenant's byte quota is at most the node's capacity, so an attach is refused by quota (403) before placement
could run out of room (503).
"""

import os

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

CACHES_PATHS = r"^/(api/v1/caches|\.well-known/jwks\.json)"
MAX_EXAMPLES = int(os.environ.get("KCAAS_FUZZ_EXAMPLES", "10"))
TIER_LIMIT = 2**50  # the most a node may report per tier (fleet) and the most a tenant quota may hold per tier


def test_caches_endpoints_conform_to_the_schema(wsgi_app, make_tenant, make_node):
    make_node(device=TIER_LIMIT, dram=TIER_LIMIT, ssd=TIER_LIMIT)
    tenant = make_tenant(max_device_bytes=TIER_LIMIT, max_dram_bytes=TIER_LIMIT, max_ssd_bytes=TIER_LIMIT)
    headers = {"Authorization": f"Bearer {tenant.raw_key}"}
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app).include(path_regex=CACHES_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.definition.raw["operationId"] for op in operations) == [
        "caches_attach",
        "caches_detach",
        "caches_list",
        "caches_recover",
        "caches_retrieve",
        "caches_tokens_create",
        "caches_tokens_revoke",
        "caches_tokens_revoke_all",
        "jwks",
    ]
    for operation in operations:
        operation_id = operation.definition.raw["operationId"]
        excluded = [positive_data_acceptance] if operation_id == "caches_attach" else []
        modes = [(GenerationMode.POSITIVE, MAX_EXAMPLES), (GenerationMode.NEGATIVE, MAX_EXAMPLES // 2)]
        if operation_id == "jwks":
            modes = modes[:1]  # no parameters, no body: there is nothing to send wrong
        for mode, examples in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(headers=headers, excluded_checks=excluded)

            check()
