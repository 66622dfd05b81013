"""tenants.selectors.tenant_search and active_key_counts (read by the console's tenants list)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import selectors, services
from tenants.models import ApiKey

pytestmark = pytest.mark.django_db


def test_search_matches_a_name_part_case_insensitively_or_an_exact_id(make_tenant):
    acme, acme_labs, globex = make_tenant("Acme Corp"), make_tenant("acme labs"), make_tenant("Globex")
    assert list(selectors.tenant_search(query="ACME")) == [acme, acme_labs]
    assert list(selectors.tenant_search(query=f"  {globex.pk}  ")) == [globex]
    assert list(selectors.tenant_search(query=str(uuid.uuid4()))) == []
    assert list(selectors.tenant_search(query="")) == [acme, acme_labs, globex]
    assert list(selectors.tenant_search(query="%")) == []  # a LIKE wildcard is matched literally


def test_active_key_counts_leave_out_revoked_and_expired_keys(make_tenant, make_key):
    mine, theirs, idle = make_tenant("mine"), make_tenant("theirs"), make_tenant("idle")
    make_key(mine), make_key(mine), make_key(theirs)
    services.api_key_revoke(api_key=make_key(mine).api_key)
    expiring = make_key(mine, expires_at=timezone.now() + timedelta(minutes=5)).api_key
    now = timezone.now()
    assert selectors.active_key_counts(tenant_ids=[mine.pk, theirs.pk, idle.pk], now=now) == {mine.pk: 3, theirs.pk: 1}
    later = now + timedelta(minutes=10)
    assert selectors.active_key_counts(tenant_ids=[mine.pk], now=later) == {mine.pk: 2}
    assert ApiKey.objects.get(pk=expiring.pk).state_at(later) == "expired"


def test_tenant_by_name_or_id(make_tenant):
    tenant = make_tenant("by-name-co")
    other = services.tenant_create(name=str(uuid.uuid4()))  # a name that spells a UUID of no tenant
    assert selectors.tenant_by_name_or_id(text=tenant.name) == tenant
    assert selectors.tenant_by_name_or_id(text=f"  {tenant.name} ") == tenant
    assert selectors.tenant_by_name_or_id(text=str(tenant.pk).upper()) == tenant
    assert selectors.tenant_by_name_or_id(text=other.name) == other
    for nothing in ("", "   ", "nobody", str(uuid.uuid4()), "x" * 500):
        assert selectors.tenant_by_name_or_id(text=nothing) is None
