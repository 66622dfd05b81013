"""Node credentials: format, storage, and who may use which endpoint."""

import re

import pytest
from rest_framework.test import APIRequestFactory

from core.keys import checksum, generate_key, parse_key
from fleet.authentication import NodeCredentialAuthentication
from fleet.models import Node
from fleet.principals import NodePrincipal

from .conftest import bearer_client, capacity_body

REGISTER = "/api/v1/nodes/register"
HEARTBEAT = "/api/v1/nodes/heartbeat"
BODY = {"endpoint": "node-a.internal:7000", "capacity": capacity_body()}


def _with_secret(credential: str, secret: str) -> str:
    """The same public id with another secret and a valid checksum: well-formed, but not the node's."""
    prefix, public_id, _ = parse_key(credential)
    body = f"{prefix}_{public_id}_{secret}"
    return body + checksum(body)


def test_credential_format_and_only_a_hash_is_stored(make_node):
    handle = make_node("n1", register=False)
    assert re.fullmatch(r"kc_node_[0-9A-Za-z]{16}_[0-9A-Za-z]{49}", handle.credential)
    prefix, public_id, secret = parse_key(handle.credential)
    assert prefix == "kc_node"
    node = Node.objects.get(pk=handle.node.pk)
    assert node.credential_public_id == public_id
    stored = " ".join(str(value) for value in Node.objects.filter(pk=node.pk).values().first().values())
    assert secret not in stored and handle.credential not in stored
    assert re.fullmatch(r"[0-9a-f]{64}", node.credential_hash)


def test_two_nodes_get_distinct_credentials(make_node):
    a, b = make_node("a", register=False), make_node("b", register=False)
    assert a.credential != b.credential
    assert a.node.credential_public_id != b.node.credential_public_id


def test_valid_credential_authenticates_as_that_node(make_node):
    handle = make_node("n1", register=False)
    response = handle.client.post(REGISTER, BODY, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["node"]["id"] == str(handle.node.pk)


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda c: _with_secret(c, "A" * 43), id="wrong-secret"),
        pytest.param(lambda c: c[:-1] + ("x" if c[-1] != "x" else "y"), id="bad-checksum"),
        pytest.param(lambda c: c[:20], id="truncated"),
        pytest.param(lambda c: "kc_node_" + "é" * 10, id="non-ascii"),
    ],
)
def test_bad_node_credentials_are_refused(make_node, mangle):
    handle = make_node("n1", register=False)
    response = bearer_client(mangle(handle.credential)).post(REGISTER, BODY, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] in {"authentication_failed", "not_authenticated"}
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert Node.objects.get(pk=handle.node.pk).state == "registering"


def test_unknown_node_credential_is_refused(make_node):
    make_node("n1")
    raw, _, _ = generate_key(prefix="kc_node")  # well-formed, but issued to no node
    response = bearer_client(raw).post(HEARTBEAT, {"capacity": capacity_body()}, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "authentication_failed"


def test_missing_credential_is_refused(db):
    from rest_framework.test import APIClient

    response = APIClient().post(REGISTER, BODY, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


def test_tenant_key_is_refused_on_node_endpoints(tenant_key):
    for url, body in ((REGISTER, BODY), (HEARTBEAT, {"capacity": capacity_body()})):
        response = bearer_client(tenant_key).post(url, body, format="json")
        assert response.status_code == 401, response.json()
        assert Node.objects.count() == 0


def test_staff_user_is_refused_on_node_endpoints(staff_client):
    response = staff_client.post(REGISTER, BODY, format="json")
    assert response.status_code == 401


def test_node_credential_is_refused_on_admin_and_tenant_endpoints(make_node):
    handle = make_node("n1")
    for url in ("/api/v1/admin/nodes", f"/api/v1/admin/nodes/{handle.node.pk}", "/api/v1/keys", "/api/v1/caches"):
        response = handle.client.get(url)
        assert response.status_code == 401, (url, response.status_code)
    response = handle.client.post(f"/api/v1/admin/nodes/{handle.node.pk}/cordon")
    assert response.status_code == 401
    assert handle.refresh().state == "ready"


def test_authenticator_leaves_other_tokens_to_other_authenticators(make_node):
    factory = APIRequestFactory()
    auth = NodeCredentialAuthentication()
    for header in ("", "Basic b3BzOnB3", "Bearer kc_live_abc", "Bearer", "Token kc_node_x"):
        request = factory.get("/", HTTP_AUTHORIZATION=header) if header else factory.get("/")
        assert auth.authenticate(request) is None, header
    handle = make_node("n1")
    user, auth_obj = auth.authenticate(factory.get("/", HTTP_AUTHORIZATION=f"Bearer {handle.credential}"))
    assert isinstance(user, NodePrincipal) and user.node.pk == handle.node.pk and auth_obj.pk == handle.node.pk
    assert user.is_authenticated and not user.is_staff
