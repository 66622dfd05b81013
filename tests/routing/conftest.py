"""Routing fixtures: tenants with keys (tests/caches/conftest), and engine registrations."""

import pytest

from tests.caches.conftest import make_tenant, tenant_a, tenant_b  # noqa: F401 - fixtures


def engine_body(name: str = "engine-1", *, port: int = 5557, **overrides) -> dict:
    return {
        "name": name,
        "model": "tiny-llama",
        "block_size": 4,
        "api_base": f"http://127.0.0.1:{8000 + port % 1000}",
        "events_endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{port + 1}",
        **overrides,
    }


@pytest.fixture
def register():
    """register(tenant_handle, **body overrides) -> the registered instance's JSON (asserts 201)."""

    def make(handle, **overrides) -> dict:
        answer = handle.client.post("/api/v1/engines", engine_body(**overrides), format="json")
        assert answer.status_code == 201, answer.json()
        return answer.json()

    return make
