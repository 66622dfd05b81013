"""Shared fixtures. Control-plane tests run against the real PostgreSQL and Redis that `make test` starts."""

import os

import pytest
from django.db.backends.signals import connection_created
from hypothesis import settings as hypothesis_settings

# The network tier's store (a Mooncake master and store servers as real processes): network_store, fresh_network_store.
from tests.network_store import fresh_network_store, network_store  # noqa: F401

# CI runs every property test and fuzzer with a fixed seed (a red run blocks landing, so a finding must be
# reproducible, not a coin toss); locally they explore new inputs each run. KCAAS_FUZZ_EXAMPLES deepens the
# schemathesis runs.
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


def _allow_audit_truncate(sender, connection, **kwargs):
    """The audit table refuses TRUNCATE (audit/migrations/0002) unless the session says so: the test suite's database
    flush between transactional tests is the one caller that may (tests/audit switch it off to check the refusal)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET kcaas.audit_allow_truncate = 'on'")


connection_created.connect(_allow_audit_truncate)


@pytest.fixture(autouse=True)
def _database_is_postgresql(request):
    """Any test that touches the database must be talking to PostgreSQL, never a SQLite stand-in."""
    if "django_db_setup" not in request.fixturenames:
        return
    from django.db import connection

    assert connection.vendor == "postgresql", "control-plane tests need DATABASE_URL=postgres://... (make test)"


@pytest.fixture
def redis_client():
    """The tests' Redis database (REDIS_URL, db 15 under make test), emptied before and after the test."""
    import redis

    url = os.environ.get("REDIS_URL")
    assert url, "control-plane tests need REDIS_URL (make test starts Redis)"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def wsgi_app(db):
    """The project's WSGI application for in-process schemathesis runs. As in Django's test client, requests must
    not close the test's database connection (it holds the test transaction)."""
    from django.core.signals import request_finished, request_started
    from django.core.wsgi import get_wsgi_application
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield get_wsgi_application()
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)
