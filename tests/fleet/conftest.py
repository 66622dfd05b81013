"""Fleet fixtures: staff and plain users over real Basic authentication, nodes created and registered through the
services, and API clients holding a node credential."""

import base64
import itertools
from dataclasses import dataclass

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from fleet import services
from fleet.models import Node
from tests.fleet.node_keys import TEST_SEALING_PUBLIC_KEY

PASSWORD = "correct horse battery staple"
GIB = 2**30
_ports = itertools.count(7001)


def basic_client(username: str) -> APIClient:
    client = APIClient()
    token = base64.b64encode(f"{username}:{PASSWORD}".encode()).decode()
    client.credentials(HTTP_AUTHORIZATION=f"Basic {token}")
    return client


def bearer_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """Basic auth checks the password on every request; PBKDF2 would make each admin call cost ~0.2 s."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff_client(db) -> APIClient:
    get_user_model().objects.create_user("ops", password=PASSWORD, is_staff=True)
    return basic_client("ops")


@pytest.fixture
def user_client(db) -> APIClient:
    """An authenticated Django user who is not staff."""
    get_user_model().objects.create_user("mallory", password=PASSWORD)
    return basic_client("mallory")


@dataclass
class NodeHandle:
    node: Node
    credential: str

    @property
    def client(self) -> APIClient:
        return bearer_client(self.credential)

    def refresh(self) -> Node:
        self.node.refresh_from_db()
        return self.node


@pytest.fixture
def make_node(db):
    """make_node(name, device=, dram=, ssd=, state=, register=True, now=) -> NodeHandle.

    Registers the node (state ready, lease from `now`, the test sealing key unless sealing_public_key=None) unless
    register=False; `state` then forces a state directly.
    """

    def make(
        name,
        *,
        device=0,
        dram=0,
        ssd=0,
        state=None,
        register=True,
        now=None,
        sealing_public_key=TEST_SEALING_PUBLIC_KEY,
    ) -> NodeHandle:
        issued = services.node_create(name=name)
        if register:
            services.node_register(
                node_id=issued.node.pk,
                endpoint=f"10.0.0.1:{next(_ports)}",
                capacity={"device": device, "dram": dram, "ssd": ssd},
                now=now,
                sealing_public_key=sealing_public_key,
            )
        if state is not None:
            Node.objects.filter(pk=issued.node.pk).update(state=state)
        handle = NodeHandle(node=issued.node, credential=issued.credential)
        handle.refresh()
        return handle

    return make


def capacity_body(device=8 * GIB, dram=64 * GIB, ssd=512 * GIB) -> dict:
    return {"device": device, "dram": dram, "ssd": ssd}


@pytest.fixture
def tenant_key(db, redis_client) -> str:
    """A raw, valid tenant API key with every scope (the tenants room's services)."""
    from tenants import services as tenant_services
    from tenants.scopes import ALL_SCOPES

    tenant = tenant_services.tenant_create(name="acme")
    return tenant_services.api_key_issue(tenant=tenant, scopes=list(ALL_SCOPES)).raw_key
