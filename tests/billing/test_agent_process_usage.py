"""The real node agent process (python -m gpu_node.agent) reports usage on its own timer: the cache it provisioned
shows up as samples of the agent's boot, and the report sent on SIGTERM lands too."""

import signal
import time

import pytest

from billing.models import UsageSample
from tests.caches.conftest import BLOCK_BYTES, attach_body, wait_for_state
from tests.caches.test_node_agent_process import agent_process, control_worker  # noqa: F401 - fixtures reused

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def usage_every_second(monkeypatch):
    monkeypatch.setenv("KCAAS_NODE_USAGE_SECONDS", "1")


def _samples_of(cache_id, node_id) -> list[UsageSample]:
    return list(UsageSample.objects.filter(cache_id=cache_id, node_id=node_id).order_by("sequence"))


def test_the_agent_reports_its_caches_usage_every_period_and_once_more_on_stop(
    usage_every_second, agent_process, tenant_a
):
    process, node_id, _ = agent_process
    response = tenant_a.client.post("/api/v1/caches", attach_body(device=16 * BLOCK_BYTES), format="json")
    cache_id = wait_for_state(tenant_a.client, response.json()["id"], "ready")["id"]
    deadline = time.monotonic() + 20
    while len(_samples_of(cache_id, node_id)) < 2:
        assert time.monotonic() < deadline, "no usage reports within 20 s at a 1 s period"
        time.sleep(0.2)
    samples = _samples_of(cache_id, node_id)
    assert len({s.boot_id for s in samples}) == 1
    assert [s.sequence for s in samples] == sorted(s.sequence for s in samples)
    assert all(s.device_bytes == 0 and s.bytes_written_total == 0 for s in samples)  # nothing put yet

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    last = _samples_of(cache_id, node_id)[-1]
    assert last.sequence > samples[-1].sequence  # the report sent while stopping
