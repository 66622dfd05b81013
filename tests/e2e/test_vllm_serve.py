"""vLLM's OpenAI-compatible server (what `vllm serve` runs: its API, engine core and worker processes) with
KCaaSConnector from --kv-transfer-config, on the real service (tests/e2e/vllm_support.py): two servers of one
tenant share a cache; the second serves a prompt whose prefix only the first computed, loading it through KCaaS,
and says so in the completion's usage (prompt_tokens_details.cached_tokens) and in its Prometheus metrics; both
answer vLLM's own greedy tokens. Completions are token-id prompts (the tiny model has no tokenizer:
--skip-tokenizer-init)."""

from __future__ import annotations

import pytest

from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    START_TIMEOUT,
    VllmServer,
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
