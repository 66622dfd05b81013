"""The KV-event indexer (routing.indexer) against vLLM's own publisher (vllm.distributed.kv_events.ZmqEventPublisher,
run by the vLLM venv: tests/e2e/vllm_events.py), over real ZMQ sockets, on the live server's PostgreSQL, read back
through the REST lookup with a tenant's key:

- batches published before the indexer subscribed are replayed at once; later ones apply in order;
- a restarted indexer replays what was published while it was down (removals included) and no batch twice;
- the publisher's health check failing for KCAAS_ROUTING_STALE_SECONDS makes the instance lost (no lookup offers it);
  a restarted engine (its seq back at 0) is live again with only what it announced since;
- another tenant's lookup and listing show nothing of it.
"""

from __future__ import annotations

import json
import subprocess
import threading

import pytest
from rest_framework.test import APIClient

from audit.actions import AuditAction
from audit.models import AuditEvent
from routing.indexer import Indexer
from routing.models import EngineInstance
from tests.e2e.conftest import tenant_key
from tests.e2e.vllm_support import REPO, requires_vllm, runner_env, vllm_python
from tests.faults import free_port
from tests.waiting import eventually

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

PUBLISHER = REPO / "tests" / "e2e" / "vllm_events.py"
PROMPT = list(range(100, 118))
OTHER = list(range(500, 508))


class Publisher:
    """vLLM's ZmqEventPublisher in its own process, with a /health endpoint beside it."""

    def __init__(self, pub_port: int, health_port: int):
        self.process = subprocess.Popen(
            [
                vllm_python(),
                str(PUBLISHER),
                "publish",
                f"tcp://*:{pub_port}",
                f"tcp://*:{pub_port + 1}",
                str(health_port),
            ],
            env=runner_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def publish(self, *events: dict) -> int:
        self.process.stdin.write(json.dumps(list(events)) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["published"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def stored(hashes, tokens, parent=None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
    }


class RunningIndexer:
    """routing.indexer.Indexer on a thread of this process (its own sockets and database connections)."""

    def __init__(self):
        self.indexer = Indexer(refresh_s=0.2, health_s=0.3, stale_s=2.0)
        self.thread = threading.Thread(target=self.indexer.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.indexer.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def indexers():
    started: list[RunningIndexer] = []

    def start() -> RunningIndexer:
        started.append(RunningIndexer())
        return started[-1]

    yield start
    for running in started:
        running.stop()


def client(key: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return api


def held(api: APIClient, tokens) -> dict:
    answer = api.post("/api/v1/engines/lookup", {"model": "tiny", "token_ids": tokens}, format="json")
    assert answer.status_code == 200, answer.json()
    return {hit["name"]: hit["prefix_tokens"].get("GPU", 0) for hit in answer.json()["instances"]}


def test_the_index_follows_vllms_events_through_replays_restarts_and_loss(indexers):
    pub_port, health_port = free_port(), free_port()
    publisher = Publisher(pub_port, health_port)
    a, b = client(tenant_key()), client(tenant_key())
    body = {
        "name": "engine",
        "model": "tiny",
        "block_size": 4,
        "api_base": f"http://127.0.0.1:{health_port}",
        "events_endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{pub_port + 1}",
    }
    registered = a.post("/api/v1/engines", body, format="json")
    assert registered.status_code == 201, registered.json()
    instance_id = registered.json()["id"]

    assert publisher.publish(stored([11, 12], PROMPT[:8])) == 0  # before anyone subscribed: only a replay has it
    first = indexers()
    assert eventually(lambda: held(a, PROMPT) == {"engine": 8}, timeout=20)
    publisher.publish(stored([13], PROMPT[8:12], parent=12))
    assert eventually(lambda: held(a, PROMPT) == {"engine": 12}, timeout=20)

    first.stop()  # while the indexer is down: a removal and a new prompt
    publisher.publish({"type": "BlockRemoved", "block_hashes": [12]})
    publisher.publish(stored([21, 22], OTHER))
    indexers()
    assert eventually(lambda: held(a, OTHER) == {"engine": 8}, timeout=20)
    assert held(a, PROMPT) == {"engine": 4}
    instance = EngineInstance.objects.get(id=instance_id)
    assert (instance.next_seq, instance.events_applied, instance.gaps) == (4, 4, 0)  # each batch once, none lost

    assert held(b, PROMPT) == {} and held(b, OTHER) == {}  # another tenant: no instance at all
    assert b.get("/api/v1/engines").json() == []

    publisher.kill()  # the engine dies: its health check fails, and after stale_s it is lost
    assert eventually(lambda: held(a, PROMPT) == {}, timeout=20)
    assert EngineInstance.objects.get(id=instance_id).state == "lost"
    assert AuditEvent.objects.filter(action=AuditAction.ENGINE_LOST, target_id=str(instance_id)).exists()

    restarted = Publisher(pub_port, health_port)  # the engine restarts: seq 0 again, an empty cache
    restarted.publish(stored([31], OTHER[:4]))
    assert eventually(lambda: held(a, OTHER) == {"engine": 4}, timeout=20)
    assert held(a, PROMPT) == {"engine": 0}
    restarted.kill()
