"""Schemathesis over the audit operations, in process, as the callers they serve (staff; a tenant key with every
scope; no credentials for the public key): no 5xx, every response (JSON, JSONL and CSV) matches the published
schema, and schema-invalid requests are refused.
Check left out: positive_data_acceptance, because `from` must be before `to` (400 invalid_range), a rule across
two parameters that JSON Schema cannot state (the same exclusion, for the same kind of reason, as caches_attach in
tests/controlplane/test_schema_fuzz_all.py)."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tenants import scopes

from .events_support import issue_key, make_tenant, staff  # noqa: F401  (fixtures)

EXAMPLES = 20
PATHS = r"^(/api/v1/audit/|/\.well-known/kcaas-platform-key\.json$)"


def _operations(wsgi_app):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app)
    operations = [result.ok() for result in schema.include(path_regex=PATHS).get_all_operations()]
    assert {op.definition.raw["operationId"] for op in operations} == {
        "audit_events_list",
        "audit_export",
        "audit_digests_list",
        "platform_key",
    }
    return operations


def _fuzz(operation, headers, mode):
    @given(case=operation.as_strategy(generation_mode=mode))
    @hsettings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        case.validate_response(response, headers=headers, excluded_checks=[positive_data_acceptance])

    run()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("caller", ["staff", "tenant"])
def test_audit_operations_conform_to_their_schema(wsgi_app, staff, make_tenant, caller):
    tenant = make_tenant(scopes=scopes.ALL_SCOPES)
    authorization = (
        staff.client._credentials["HTTP_AUTHORIZATION"]
        if caller == "staff"
        else (f"Bearer {issue_key(tenant.tenant, scopes.ALL_SCOPES).raw_key}")
    )
    for operation in _operations(wsgi_app):
        allowed = caller == "staff" or operation.definition.raw["operationId"] != "audit_digests_list"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.POSITIVE and not allowed:
                continue  # a tenant key is rightly refused (403) whatever the data
            if mode is GenerationMode.NEGATIVE and not operation.definition.raw.get("parameters"):
                continue  # nothing to send wrong
            _fuzz(operation, {"Authorization": authorization}, mode)
