"""Tenants fixtures, written to be copied by the other rooms' tests.

- ``make_tenant(name=None, status="active", **quota_overrides) -> Tenant``
- ``make_key(tenant, scopes=ALL_SCOPES, **kwargs) -> IssuedKey`` (services.api_key_issue)
- ``key_client(raw_key) -> APIClient`` sending ``Authorization: Bearer <raw_key>``
- ``tenant``, ``issued_key`` (every scope), ``tenant_client`` (an APIClient holding that key)
- ``staff_client`` (a logged-in Django staff user), ``user_client`` (logged in, not staff), ``anon_client``
- ``assert_error(response, status, code)``: the one error shape, returning ``body["error"]``
- ``run_concurrently(fn, args_list)``: real threads, each with its own database connection (closed at the end)

Every test here starts and ends with an empty Redis test database (rate-limit buckets, usage counters).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth import get_user_model
from django.db import connections
from rest_framework.test import APIClient

from tenants import services
from tenants.models import Tenant
from tenants.scopes import ALL_SCOPES

_names = itertools.count(1)


@pytest.fixture(autouse=True)
def _empty_redis(redis_client):
    """Every tenants test runs on an empty Redis db (the root conftest's fixture flushes before and after)."""
    return redis_client


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content)
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["details"], dict)
    assert body["error"]["code"] == code, body
    return body["error"]


def key_client(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


@pytest.fixture
def make_tenant(db):
    def make(name: str | None = None, *, status: str = Tenant.Status.ACTIVE, **quota) -> Tenant:
        tenant = services.tenant_create(name=name or f"tenant-{next(_names)}")
        if quota:
            services.quota_update(tenant=tenant, **quota)
        if status != Tenant.Status.ACTIVE:
            Tenant.objects.filter(pk=tenant.pk).update(status=status)
            tenant.refresh_from_db()
        return tenant

    return make


@pytest.fixture
def make_key(db):
    def make(tenant: Tenant, scopes=ALL_SCOPES, **kwargs) -> services.IssuedKey:
        return services.api_key_issue(tenant=tenant, scopes=list(scopes), **kwargs)

    return make


@pytest.fixture
def tenant(make_tenant) -> Tenant:
    return make_tenant("acme")


@pytest.fixture
def issued_key(tenant, make_key) -> services.IssuedKey:
    return make_key(tenant)


@pytest.fixture
def tenant_client(issued_key) -> APIClient:
    return key_client(issued_key.raw_key)


def _logged_in(username: str, *, is_staff: bool) -> APIClient:
    user = get_user_model().objects.create_user(username, is_staff=is_staff)
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def staff_client(db) -> APIClient:
    return _logged_in("ops", is_staff=True)


@pytest.fixture
def user_client(db) -> APIClient:
    return _logged_in("mallory", is_staff=False)


@pytest.fixture
def anon_client() -> APIClient:
    return APIClient()


def run_concurrently(fn, args_list, *, max_workers: int | None = None) -> list:
    """Call ``fn(*args)`` for every args tuple from ``max_workers`` threads (default: one per call), all released
    together once every call is queued; results in order.

    Each thread has its own database connection, closed when it finishes (needs django_db(transaction=True)).
    """
    start = threading.Event()

    def call(args):
        try:
            start.wait(timeout=30)
            return fn(*args)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=max_workers or len(args_list)) as pool:
        futures = [pool.submit(call, args) for args in args_list]
        start.set()
        return [future.result() for future in futures]
