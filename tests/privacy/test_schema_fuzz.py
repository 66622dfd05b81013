"""Schemathesis over the privacy endpoints of the published schema: no 5xx, every response matches the schema
(positive and negative generation), for a tenant key able to export and a staff user."""

import base64
import os

import pytest
import schemathesis
from django.contrib.auth import get_user_model
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tenants import services

FAST_HASHER = ["django.contrib.auth.hashers.MD5PasswordHasher"]
PRIVACY_PATHS = r"^/api/v1/(export|admin/tenants/[^/]+/(erasure|export))"
MAX_EXAMPLES = int(os.environ.get("KCAAS_FUZZ_EXAMPLES", "10"))


@pytest.fixture
def credentials(db):
    tenant = services.tenant_create(name="fuzzed-privacy")
    services.quota_update(tenant=tenant, max_requests_per_second=100_000)
    scopes = ["audit:read", "caches:read", "keys:read", "usage:read"]
    raw = services.api_key_issue(tenant=tenant, scopes=scopes).raw_key
    with override_settings(PASSWORD_HASHERS=FAST_HASHER):
        get_user_model().objects.create_user("fuzz-privacy", password="pw", is_staff=True)
        yield {"tenant": f"Bearer {raw}", "staff": "Basic " + base64.b64encode(b"fuzz-privacy:pw").decode()}


def test_privacy_endpoints_conform_to_the_schema(wsgi_app, credentials):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app).include(path_regex=PRIVACY_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.definition.raw["operationId"] for op in operations) == [
        "admin_tenant_erasure_cancel",
        "admin_tenant_erasure_receipt",
        "admin_tenant_erasure_request",
        "admin_tenant_erasure_retrieve",
        "admin_tenant_export_retrieve",
        "export_retrieve",
    ]
    for operation in operations:
        who = "staff" if operation.path.startswith("/api/v1/admin/") else "tenant"
        for mode, examples in ((GenerationMode.POSITIVE, MAX_EXAMPLES), (GenerationMode.NEGATIVE, MAX_EXAMPLES // 2)):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(headers={"Authorization": credentials[who]})

            check()
