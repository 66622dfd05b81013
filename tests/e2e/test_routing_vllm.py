"""KV-aware routing in front of real vLLM servers (vLLM's OpenAI server, prefix caching on, publishing its KV events
over ZMQ with a replay socket), registered with the live control plane, indexed by routing.indexer, and the router
(`python -m kcaas.router`, its own process) in front of them:

- a conversation's next turn lands on the instance whose device memory holds its earlier turns (the router's
  x-kcaas-instance), and vLLM reports those tokens as its own prefix-cache hit;
- another conversation is spread by load to the other instance; its next turn follows it there;
- the router of another tenant has no instance to route to (503), and its lookups see none;
- an instance that dies: the router's next request for its conversation fails over to the other instance, and the
  indexer soon marks it lost (lookups no longer offer it);
- with the KCaaS connector on every instance, the request that fails over to an instance that never saw its prefix
  loads that prefix from the tenant's cache instead of recomputing it (vLLM counts it as an external hit).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from routing.cache_follower import CacheFollower
from routing.indexer import Indexer
from tests.e2e.conftest import client_tls
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    REPO,
    START_TIMEOUT,
    VllmServer,
    engine_spec,
    requires_vllm,
    runner_env,
    tenants,
    vllm_agent,
    vllm_agent_launcher,
    vllm_models,
    wait_cached,
)
from tests.faults import free_port
from tests.waiting import eventually

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32 for this head size)
MODEL = "tiny"
TURN_1 = {"a": PROMPTS["a_seed"][:200], "b": PROMPTS["unrelated"][:200]}
TURN_2 = {name: prompt + PROMPTS["b_other"][-40:] for name, prompt in TURN_1.items()}


def events_args(port: int) -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 1}",
    }
    return ("--enable-prefix-caching", "--block-size", str(BLOCK), "--kv-events-config", json.dumps(config))


class RouterProcess:
    def __init__(self, kcaas_url: str, api_key: str, workdir):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"router-{self.port}.log"
        self._log = open(self.log_path, "w+")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kcaas.router",
                "--kcaas-url",
                kcaas_url,
                "--model",
                MODEL,
                "--port",
                str(self.port),
            ],
            cwd=REPO,
            env={**runner_env(api_key), "PYTHONPATH": str(REPO)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as answer:
            return answer.read().decode()

    def complete(self, prompt: list[int]) -> tuple[str, dict]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.headers["x-kcaas-instance"], json.load(answer)

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self._log.close()


def test_a_conversation_follows_its_kv_and_another_tenant_routes_nowhere(live_server, vllm_models, tenants, tmp_path):
    tenant, stranger = tenants(), tenants()
    ports = {name: free_port() for name in ("one", "two")}
    servers = {
        name: VllmServer(
            vllm_models["llama"],
            None,
            runner_env(),
            tmp_path,
            name,
            extra_args=events_args(port),
            served_model_name=MODEL,
        )
        for name, port in ports.items()
    }
    indexer = Indexer(refresh_s=0.2, health_s=0.5, stale_s=3.0)
    thread = threading.Thread(target=indexer.run, daemon=True)
    routers: list[RouterProcess] = []
    try:
        for name, server in servers.items():
            tenant.client.register_engine(
                name,
                model=MODEL,
                block_size=BLOCK,
                api_base=server.url,
                events_endpoint=f"tcp://127.0.0.1:{ports[name]}",
                replay_endpoint=f"tcp://127.0.0.1:{ports[name] + 1}",
            )
        thread.start()
        for server in servers.values():
            assert eventually(server.healthy, timeout=START_TIMEOUT, interval=0.5), server.log_tail()
        router = RouterProcess(live_server.url, tenant.key, tmp_path)
        other = RouterProcess(live_server.url, stranger.key, tmp_path)
        routers += [router, other]
        assert eventually(lambda: router.get("/health") == 200, timeout=60), router.log_path.read_text()[-3000:]

        first_a, _ = router.complete(TURN_1["a"])
        first_b, _ = router.complete(TURN_1["b"])
        assert {first_a, first_b} == {"one", "two"}  # nothing cached yet: spread by load (then rotation)

        def indexed(name: str, prompt: list[int]) -> bool:
            return lookup(tenant, prompt).get(name, 0) >= len(prompt) // BLOCK * BLOCK

        assert eventually(lambda: indexed(first_a, TURN_1["a"]) and indexed(first_b, TURN_1["b"]), timeout=30)

        def queues() -> list[tuple[int, int]]:
            instances = tenant.client.prefix_lookup(MODEL, []).instances
            return [(hit.requests_waiting, hit.requests_running) for hit in instances]

        # the queue each reports on /metrics, read by the health checks: a block's event can arrive before the
        # request that stored it has finished, so the last check may still have seen it running
        assert eventually(lambda: queues() == [(0, 0), (0, 0)], timeout=30), queues()
        for name, first in (("b", first_b), ("a", first_a)):  # in the other order: round-robin would swap them
            went, answer = router.complete(TURN_2[name])
            assert went == first, f"turn 2 of {name} went to {went}, its KV is on {first}"
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(TURN_1[name]) // BLOCK * BLOCK

        assert lookup(stranger, TURN_1["a"]) == {}
        assert eventually(lambda: other.get("/health") == 503, timeout=30)  # the stranger's router: no instance

        # the instance holding conversation a dies: its next turn still gets an answer, from the other one
        servers[first_a].close()
        prompt = TURN_2["a"] + PROMPTS["a_other"][-20:]
        went, answer = router.complete(prompt)
        assert went != first_a and answer["usage"]["prompt_tokens"] == len(prompt)
        assert "kcaas_router_failovers_total 1" in router.text("/metrics")  # it tried the dead one first
        assert eventually(lambda: first_a not in lookup(tenant, TURN_1["a"]), timeout=30)  # the indexer lost it
    finally:
        indexer.stop.set()
        thread.join(timeout=10)
        for running in routers:
            running.close()
        for server in servers.values():
            server.close()


def test_with_the_connector_a_request_sent_where_its_prefix_is_not_loads_it_from_kcaas(
    live_server, pki, vllm_models, vllm_agent, tenants, tmp_path
):
    tenant = tenants()
    cache = tenant.attach("chat", engine_spec(vllm_models["llama"]))
    transfer = {
        "kv_connector": "KCaaSConnector",
        "kv_connector_module_path": "kcaas.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kcaas_url": live_server.url, "cache": "chat", "ca_file": pki["ca"]},
    }
    ports = {name: free_port() for name in ("one", "two")}
    servers = {
        name: VllmServer(
            vllm_models["llama"], transfer, tenant.env(), tmp_path, name, extra_args=events_args(port),
            served_model_name=MODEL,
        )
        for name, port in ports.items()
    }  # fmt: skip
    indexer = Indexer(refresh_s=0.2, health_s=0.5, stale_s=3.0, caches=CacheFollower(ssl_context=client_tls(pki)))
    thread = threading.Thread(target=indexer.run, daemon=True)
    router = None
    try:
        for name, server in servers.items():
            tenant.client.register_engine(
                name, model=MODEL, block_size=BLOCK, api_base=server.url,
                events_endpoint=f"tcp://127.0.0.1:{ports[name]}", replay_endpoint=f"tcp://127.0.0.1:{ports[name] + 1}",
            )  # fmt: skip
        thread.start()
        for server in servers.values():
            assert eventually(server.healthy, timeout=START_TIMEOUT, interval=0.5), server.log_tail()
        router = RouterProcess(live_server.url, tenant.key, tmp_path)
        assert eventually(lambda: router.get("/health") == 200, timeout=60), router.log_path.read_text()[-3000:]

        first, answer = router.complete(PROMPTS["a_seed"])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        saved = len(PROMPTS["a_seed"]) // BLOCK * BLOCK
        wait_cached(tenant.data_plane(cache), {"a_seed": saved})  # the connector saved the prefix to the cache
        assert eventually(lambda: lookup(tenant, PROMPTS["a_seed"]).get(first, 0) >= saved, timeout=30)

        def in_cache() -> dict:  # the lookup's answer for the tenant's cache, on its node's pool
            return {hit.name: hit.prefix_tokens for hit in tenant.client.prefix_lookup(MODEL, PROMPTS["a_seed"]).caches}

        assert eventually(lambda: in_cache().get("chat", {}).get("GPU", 0) >= saved, timeout=30), in_cache()

        servers[first].close()  # where the prefix is in device memory: gone
        went, answer = router.complete(PROMPTS["a_seed"] + PROMPTS["b_other"][-20:])
        assert went != first
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= saved  # loaded, not recomputed
        assert servers[went].metric("vllm:external_prefix_cache_hits_total") >= saved
    finally:
        indexer.stop.set()
        thread.join(timeout=10)
        if router is not None:
            router.close()
        for server in servers.values():
            server.close()


def lookup(tenant, prompt: list[int]) -> dict[str, int]:
    answer = tenant.client.prefix_lookup(MODEL, prompt)
    return {hit.name: hit.prefix_tokens.get("GPU", 0) for hit in answer.instances}
