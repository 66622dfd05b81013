"""Schemathesis over the tenants endpoints of the published schema: no 5xx, every response matches the schema,
schema-valid requests are accepted and schema-violating ones refused (positive and negative generation).

Two callers: a tenant key with the keys scopes (keys endpoints) and a staff user over Basic auth (admin endpoints).
Kept small (a few examples per operation) so the suite stays fast; the whole-schema run is the project's.
"""

import base64
import os

import pytest
import schemathesis
from django.contrib.auth import get_user_model
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tenants import services

FAST_HASHER = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # Basic auth hashes per request; tests only
TENANTS_PATHS = r"^/api/v1/(keys|admin/tenants(?!/[^/]+/(erasure|export)))"  # the privacy room fuzzes those
MAX_EXAMPLES = int(os.environ.get("KCAAS_FUZZ_EXAMPLES", "10"))  # per operation; raise it for a deeper run


@pytest.fixture
def credentials(db):
    tenant = services.tenant_create(name="fuzzed")
    services.quota_update(tenant=tenant, max_requests_per_second=100_000)
    raw = services.api_key_issue(tenant=tenant, scopes=["keys:read", "keys:write", "caches:read"]).raw_key
    with override_settings(PASSWORD_HASHERS=FAST_HASHER):
        get_user_model().objects.create_user("fuzz-ops", password="pw", is_staff=True)
        yield {"tenant": f"Bearer {raw}", "staff": "Basic " + base64.b64encode(b"fuzz-ops:pw").decode()}


def test_tenants_endpoints_conform_to_the_schema(wsgi_app, credentials):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app).include(path_regex=TENANTS_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 11

    for operation in operations:
        who = "staff" if operation.path.startswith("/api/v1/admin/") else "tenant"
        for mode, examples in ((GenerationMode.POSITIVE, MAX_EXAMPLES), (GenerationMode.NEGATIVE, MAX_EXAMPLES // 2)):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(headers={"Authorization": credentials[who]})

            check()
