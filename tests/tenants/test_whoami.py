from tests.tenants.conftest import key_client


def test_a_tenant_key_sees_its_tenant_key_and_scopes(make_tenant, make_key):
    tenant = make_tenant()
    issued = make_key(tenant, scopes=["caches:read", "keys:write"])
    response = key_client(issued.raw_key).get("/api/v1/whoami")
    assert response.status_code == 200
    assert response.json() == {
        "kind": "tenant_key",
        "tenant_id": str(tenant.id),
        "key_id": str(issued.api_key.id),
        "scopes": sorted(issued.api_key.scopes),
    }


def test_staff_and_plain_users(staff_client, user_client):
    assert staff_client.get("/api/v1/whoami").json()["kind"] == "staff"
    response = user_client.get("/api/v1/whoami")
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"


def test_no_or_bad_credentials_are_401(db, client):
    assert client.get("/api/v1/whoami").status_code == 401
    bad = key_client("kc_live_AAAAAAAAAAAAAAAA_" + "x" * 49)
    assert bad.get("/api/v1/whoami").status_code == 401
