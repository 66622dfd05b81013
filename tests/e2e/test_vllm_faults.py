"""A real vLLM engine over KCaaS when the cache fails it (tests/e2e/vllm_support.py): whatever the node does, every
request completes, with exactly the tokens of vLLM alone (what KCaaS cannot give is recomputed), and nothing hangs.

- the node agent is SIGKILLed while an engine runs (after it saved and hit), and before another engine starts;
- a load that fails after the promise: a test-only connector (tests/e2e/vllm_faulty_connector.py) deletes the
  prompt from the node right after the real connector promised its prefix; the cache held random KV for it, so a
  load of anything at all would show in the tokens.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import random_kv
from tests.e2e.vllm_support import (  # noqa: F401 - fixtures
    PROMPTS,
    assert_same_as_baseline,
    baseline,
    connector_job,
    connector_stat,
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

pytestmark = [requires_vllm, pytest.mark.django_db(transaction=True)]

ROUND_TIMEOUT = 120.0  # a round over a dead node: lookups time out in 100 ms and back off, nothing waits longer


def test_the_node_dies_while_an_engine_runs_and_before_another_starts(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    model = vllm_models["llama"]
    tenant = tenants()
    cache = tenant.attach("chat", engine_spec(model))
    common = dict(role="kv_both", url=live_server.url, cache="chat", pki=pki)
    after_kill = ["b_other", "a_seed", "unrelated"]
    rounds = [{"prompts": prompts(*names)} for names in (["a_seed", "b_seed"], ["a_other"], after_kill)]
    running = vllm_processes.start(
        connector_job(model, [], rounds=rounds, pause_between_rounds=True, **common), tenant.env(), "running"
    )

    seeded = running.message()
    assert_same_as_baseline(seeded, ["a_seed", "b_seed"], baseline["llama"])
    wait_cached(tenant.data_plane(cache), {"a_seed": 256, "b_seed": 384})
    running.go()
    hit = running.message()
    assert hit["num_cached_tokens"] == [256]  # the node serves this engine ...
    assert_same_as_baseline(hit, ["a_other"], baseline["llama"])

    vllm_agent.kill()  # ... until it is SIGKILLed, its connections open
    late = vllm_processes.start(connector_job(model, prompts("a_other", "b_other"), **common), tenant.env(), "late")
    running.go()
    orphaned = running.message(timeout=ROUND_TIMEOUT)
    assert orphaned["num_cached_tokens"] == [0, 0, 0]  # misses: recomputed, not failed
    assert_same_as_baseline(orphaned, after_kill, baseline["llama"])
    assert orphaned["elapsed_s"] < 30, orphaned["elapsed_s"]

    started_late = late.message()  # an engine started with its cache's node dead serves all the same
    assert started_late["num_cached_tokens"] == [0, 0]
    assert_same_as_baseline(started_late, ["a_other", "b_other"], baseline["llama"])


def test_a_load_that_fails_after_the_promise_is_recomputed(
    live_server, pki, vllm_models, baseline, vllm_agent, tenants, vllm_processes
):
    model = vllm_models["llama"]
    tenant = tenants()
    spec = engine_spec(model)
    cache = tenant.attach("chat", spec)
    dp = tenant.data_plane(cache)
    for seed, shared in enumerate((PROMPTS["a_other"][:256], PROMPTS["b_other"][:256])):
        dp.put(shared, random_kv(spec, 256, seed=seed))  # what a load would scatter if the promise were kept
    names = ["a_other", "b_other"]
    job = connector_job(
        model,
        prompts(*names),
        role="kv_consumer",
        url=live_server.url,
        cache="chat",
        pki=pki,
        connector="DeletingKCaaSConnector",
        connector_module="tests.e2e.vllm_faulty_connector",
    )
    engine = vllm_processes.start(job, tenant.env(), "faulty")

    result = engine.message(timeout=ROUND_TIMEOUT + 180)
    assert result["num_cached_tokens"] == [256, 256]  # promised (vLLM counts the promise) ...
    assert connector_stat(result, "loaded_tokens") == 0  # ... found gone at load time ...
    assert connector_stat(result, "failed_tokens") == 512  # ... reported, and recomputed:
    assert_same_as_baseline(result, names, baseline["llama"])
    engine.close()
    assert engine.stderr.count("vllm_faulty_connector: deleted") == 2
    assert [dp.lookup(PROMPTS[name]) for name in names] == [0, 0]
