"""The whole service, end to end, with real processes: the control plane (pytest-django's live server on PostgreSQL),
the control queue's Celery worker (a thread, over Redis), a node agent PROCESS (python -m gpu_node.agent) with its
TLS 1.3 data plane on an ephemeral port (a throwaway CA and server certificate), tenants and keys made
through the tenants services, and the SDK (kcaas.Client, TokenSource, DataPlaneClient, HFConnector) as a tenant
would use it.

- tenant A attaches a cache matching a tiny Llama (float32) and generates twice with a shared system prompt: the
  second run is served the prefix, and its tokens and logits equal plain model.generate bit for bit;
- isolation: tenant B's data token presented for A's cache gets exactly the answer a nonexistent cache gets, and
  B's own cache misses A's prompt;
- prefill/decode handoff: one client prefills and puts, a second client (its own API client, token and connection)
  gets the prefix and decodes: its tokens equal plain model.generate, its logits equal a single-process run.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import kcaas
from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector, ReadOnlyStore
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from kcaas.errors import KcaasError
from kcaas.tokens import TokenSource
from tests.e2e.conftest import FP32_ROUNDING, client_tls, model_prefix, random_tokens, spec_for, tenant_key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("deterministic_threads")]
GENERATE = dict(max_new_tokens=6, do_sample=False, output_logits=True)


def plain_generate(model, input_ids, cache=None):
    """The model alone; with `cache`, starting from it (tests.e2e.conftest.model_prefix)."""
    extra = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        return model.generate(input_ids, return_dict_in_generate=True, **GENERATE, **extra)


def close_output(a, b) -> bool:
    """The same tokens, logits equal to fp32 rounding (a run without a cache prefills every row at once)."""
    return (
        torch.equal(a.sequences, b.sequences)
        and len(a.logits) == len(b.logits)
        and all(torch.allclose(x, y, **FP32_ROUNDING) for x, y in zip(a.logits, b.logits))
    )


def same_output(a, b) -> bool:
    return (
        torch.equal(a.sequences, b.sequences)
        and len(a.logits) == len(b.logits)
        and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    )


# ---- the test --------------------------------------------------------------------------------------------------------


def test_attach_generate_isolate_and_hand_off_through_the_real_service(live_server, agent, pki, model):
    spec = spec_for(model)
    capacity = {"device": 64 * spec.block_bytes}
    tls = client_tls(pki)
    opened: list = []

    def api(key: str) -> kcaas.Client:
        client = kcaas.Client(live_server.url, key)
        opened.append(client)
        return client

    def data_plane(client: kcaas.Client, cache, token=None) -> DataPlaneClient:
        dp = DataPlaneClient(
            cache.endpoint,
            token or TokenSource(client, cache.id, access="readwrite"),
            cache.id,
            spec,
            ssl_context=tls,
            timeout=10.0,
        )
        opened.append(dp)
        return dp

    try:
        key_a, key_b = tenant_key(), tenant_key()
        client_a, client_b = api(key_a), api(key_b)

        # 1. tenant A: attach, generate twice with a shared system prompt; the second run hits and is bit-exact
        #    against the model given the same prefix, and equal to fp32 rounding to the model with no cache
        cache_a = client_a.attach("chat", spec, capacity, timeout=30)
        assert cache_a.is_ready and cache_a.endpoint == agent.endpoint
        dp_a = data_plane(client_a, cache_a)
        connector = HFConnector(model, dp_a)
        system = random_tokens(40, seed=3)
        first = torch.cat([system, torch.tensor([[5, 6, 7]])], dim=1)
        second = torch.cat([system, torch.tensor([[9, 8, 7, 6]])], dim=1)

        served_first = connector.generate(first, **GENERATE)
        assert connector.last_reuse.num_cached_tokens == 0
        assert same_output(served_first, plain_generate(model, first))
        served = connector.generate(second, **GENERATE)
        assert connector.last_reuse.num_cached_tokens == 40  # the shared system prompt, not recomputed
        assert same_output(served, plain_generate(model, second, model_prefix(model, first, 40)))  # bit for bit
        assert close_output(served, plain_generate(model, second))
        # over the SDK's default token (read), a connector that would store is refused at once, naming the fix; one
        # told read_only=True reuses the prefix and stores nothing
        reader = data_plane(client_a, cache_a, TokenSource(client_a, cache_a.id))
        assert reader.read_only
        with pytest.raises(ReadOnlyStore, match="readwrite"):
            HFConnector(model, reader)
        stored = reader.lookup(second[0])
        decoder = HFConnector(model, reader, read_only=True)
        assert close_output(decoder.generate(second, **GENERATE), plain_generate(model, second))
        assert decoder.last_reuse.num_cached_tokens >= 40 and reader.lookup(second[0]) == stored  # nothing put

        # 2. isolation: B's token against A's cache answers exactly what a nonexistent cache answers
        cache_b = client_b.attach("chat", spec, capacity, timeout=30)
        token_b = client_b.issue_token(
            cache_b.id, access="readwrite"
        ).token  # a plain string: no refresh-and-retry in the way

        def refusal(cache_id: str) -> DataPlaneError:
            dp = DataPlaneClient(cache_a.endpoint, token_b, cache_id, spec, ssl_context=tls, timeout=10.0)
            opened.append(dp)
            with pytest.raises(DataPlaneError) as info:
                dp.lookup(second[0])
            return info.value

        against_a, against_nothing = refusal(cache_a.id), refusal(str(uuid.uuid4()))
        assert against_a.code == against_nothing.code == "not_found"
        assert (against_a.status, against_a.message, against_a.details) == (
            against_nothing.status,
            against_nothing.message,
            against_nothing.details,
        )
        assert cache_a.id not in str(against_a.message) and cache_a.id not in str(against_a.details)

        # ... and so does B's key asking the control plane for a data token for A's cache
        def token_refusal(cache_id: str) -> KcaasError:
            with pytest.raises(KcaasError) as info:
                client_b.issue_token(cache_id, access="readwrite")
            return info.value

        api_a, api_nothing = token_refusal(cache_a.id), token_refusal(str(uuid.uuid4()))
        assert api_a.status == 404
        assert (api_a.status, api_a.code, api_a.message) == (api_nothing.status, api_nothing.code, api_nothing.message)
        # ... and B's own (empty) cache misses A's identical prompt
        dp_b = data_plane(client_b, cache_b)
        assert dp_b.lookup(second[0]) == 0
        n, _ = dp_b.get(second[0])
        assert n == 0
        assert dp_a.lookup(second[0]) == len(second[0])  # A's entries are still there

        # 3. prefill/decode handoff: one client prefills and puts, another (own API client, token and connection)
        #    gets the prefix and decodes
        prompt = random_tokens(49, seed=11)  # 3 full blocks + the one token the decoder must run itself
        HFConnector(model, data_plane(api(key_a), cache_a)).forward(prompt)  # the prefill side
        decoder = HFConnector(model, data_plane(api(key_a), cache_a))
        decoded = decoder.generate(prompt, **GENERATE)
        assert decoder.last_reuse.num_cached_tokens == 48

        local = HFConnector(model, PagedKVCache(spec, hash_key=b"single-process-k" * 2, num_blocks=64, device="cpu"))
        local.forward(prompt)
        single = local.generate(prompt, **GENERATE)  # the same run in one process, no service
        assert local.last_reuse.num_cached_tokens == 48
        assert same_output(decoded, single)
        plain = plain_generate(model, prompt)
        assert torch.equal(decoded.sequences, plain.sequences)
        # (a 1-row forward takes another BLAS path than the full prompt's: logits agree to fp32 rounding)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(decoded.logits, plain.logits))
    finally:
        for thing in reversed(opened):
            thing.close()
