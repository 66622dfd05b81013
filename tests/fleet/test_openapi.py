"""Schemathesis over fleet's operations, in process, as the callers they are meant for (a node, staff): no 5xx,
and every response matches the OpenAPI schema drf-spectacular publishes."""

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from .conftest import GIB, PASSWORD

EXAMPLES_PER_OPERATION = 30


@pytest.fixture(autouse=True)
def _keep_the_test_connection():
    """The WSGI handler closes "old" connections at each request's start and end, which would close the test's
    transaction; Django's own test client disconnects the same receivers."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _operations(path_regex: str):
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
    operations = [result.ok() for result in schema.include(path_regex=path_regex).get_all_operations()]
    assert operations, path_regex
    return operations


def _fuzz(operation, headers, excluded_checks=()):
    @given(case=operation.as_strategy())
    @hsettings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        case.validate_response(response, headers=headers, excluded_checks=list(excluded_checks))

    run()


@pytest.mark.parametrize(
    "path_regex, excluded",
    [
        # The host:port grammar of `endpoint` (DNS name, IPv4 without 0.0.0.0, bracketed IPv6, port 1-65535) is
        # documented in words, not as a JSON-schema pattern, so a schema-valid string may still be refused (400).
        (r"^/api/v1/nodes/register$", [positive_data_acceptance]),
        (r"^/api/v1/nodes/heartbeat$", []),
    ],
)
def test_node_endpoints_conform_to_the_schema(make_node, path_regex, excluded):
    handle = make_node("fuzzed", device=8 * GIB)
    for operation in _operations(path_regex):
        _fuzz(operation, {"Authorization": f"Bearer {handle.credential}"}, excluded)


def test_admin_endpoints_conform_to_the_schema(staff_client, make_node):
    import base64

    make_node("listed", device=8 * GIB)
    token = base64.b64encode(f"ops:{PASSWORD}".encode()).decode()
    for operation in _operations(r"^/api/v1/admin/nodes"):
        _fuzz(operation, {"Authorization": f"Basic {token}"})
