"""The whole service, end to end, with real processes: the control plane (pytest-django's live server on PostgreSQL),
the control queue's Celery worker (a thread, over Redis), a node agent PROCESS (python -m gpu_node.agent) with its
TLS 1.3 data plane on an ephemeral port (a throwaway CA and server certificate made here), tenants and keys made
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

import os
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import transformers
from cryptography import x509

import kcaas
from controlplane.celery import app as control_app
from fleet import services as fleet_services
from gpu_node.dev_pki import write_dev_pki
from gpu_node.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from kcaas.errors import KcaasError
from kcaas.spec import KVCacheSpec
from kcaas.tokens import TokenSource
from tenants import services as tenant_services
from tests.caches.conftest import free_port, purge_node_queue, running_workers

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]
GENERATE = dict(max_new_tokens=6, do_sample=False, output_logits=True)


# ---- the model --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def deterministic_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # with eager attention: the model's own arithmetic is bit-stable across lengths
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def spec_for(model) -> KVCacheSpec:
    c = model.config
    return KVCacheSpec("tiny-llama-random@seed0", c.num_hidden_layers, c.num_key_value_heads,
                       c.hidden_size // c.num_attention_heads, 16, "float32", "float32")  # fmt: skip


def plain_generate(model, input_ids):
    with torch.no_grad():
        return model.generate(input_ids, return_dict_in_generate=True, **GENERATE)


def same_output(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits)
    )


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# ---- PKI --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (PEM files), valid for an hour."""
    return write_dev_pki(tmp_path_factory.mktemp("e2e-pki"), server_name="e2e node")


def client_tls(pki) -> ssl.SSLContext:
    """Trusts only the test CA (TLS 1.3, hostname checked against the certificate's 127.0.0.1 SAN)."""
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


# ---- processes --------------------------------------------------------------------------------------------------------


@pytest.fixture
def control_worker():
    with running_workers((control_app, ["control"])) as (worker,):
        yield worker


@pytest.fixture
def agent(live_server, control_worker, pki, tmp_path, model):
    """A real agent process serving TLS 1.3 on an ephemeral port; killed (and its queue purged) afterwards."""
    block_bytes = spec_for(model).block_bytes
    issued = fleet_services.node_create(name=f"e2e-node-{uuid.uuid4().hex[:6]}")
    endpoint = f"127.0.0.1:{free_port()}"
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "KCAAS_CONTROL_URL": live_server.url,
        "KCAAS_NODE_CREDENTIAL": issued.credential,
        "KCAAS_NODE_ENDPOINT": endpoint,
        "KCAAS_NODE_DEVICE_BYTES": str(512 * block_bytes),
        "KCAAS_NODE_TORCH_DEVICE": "cpu",
        "KCAAS_NODE_TLS_CERT": pki["cert"],
        "KCAAS_NODE_TLS_KEY": pki["key"],
        "KCAAS_NODE_METRICS_PORT": str(free_port()),
        "LOG_LEVEL": "WARNING",
    }
    stderr = open(tmp_path / "agent.stderr", "w+")  # a file, not a pipe: a chatty agent can never block on it
    process = subprocess.Popen([sys.executable, "-m", "gpu_node.agent"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=stderr, text=True)  # fmt: skip
    try:
        line = process.stdout.readline()
        if "ready" not in line:
            process.kill()
            process.wait()
            stderr.seek(0)
            pytest.fail(f"agent did not start: {line!r} {stderr.read()[-3000:]}")
        yield endpoint
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stdout.close()
        stderr.close()
        purge_node_queue(issued.node.pk)


def tenant_key() -> str:
    tenant = tenant_services.tenant_create(name=f"e2e-tenant-{uuid.uuid4().hex[:8]}")
    tenant_services.quota_update(tenant=tenant, max_requests_per_second=100_000)
    return tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read", "caches:write"]).raw_key


# ---- the test ---------------------------------------------------------------------------------------------------------


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
        dp = DataPlaneClient(cache.endpoint, token or TokenSource(client, cache.id), cache.id, spec,
                             ssl_context=tls, timeout=10.0)  # fmt: skip
        opened.append(dp)
        return dp

    try:
        key_a, key_b = tenant_key(), tenant_key()
        client_a, client_b = api(key_a), api(key_b)

        # 1. tenant A: attach, generate twice with a shared system prompt; the second run hits and is bit-exact
        cache_a = client_a.attach("chat", spec, capacity, timeout=30)
        assert cache_a.is_ready and cache_a.endpoint == agent
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
        assert same_output(served, plain_generate(model, second))

        # 2. isolation: B's token against A's cache answers exactly what a nonexistent cache answers
        cache_b = client_b.attach("chat", spec, capacity, timeout=30)
        token_b = client_b.issue_token(cache_b.id).token  # a plain string: no refresh-and-retry in the way

        def refusal(cache_id: str) -> DataPlaneError:
            dp = DataPlaneClient(cache_a.endpoint, token_b, cache_id, spec, ssl_context=tls, timeout=10.0)
            opened.append(dp)
            with pytest.raises(DataPlaneError) as info:
                dp.lookup(second[0])
            return info.value

        against_a, against_nothing = refusal(cache_a.id), refusal(str(uuid.uuid4()))
        assert against_a.code == against_nothing.code == "not_found"
        assert (against_a.status, against_a.message, against_a.details) == (
            against_nothing.status, against_nothing.message, against_nothing.details)
        assert cache_a.id not in str(against_a.message) and cache_a.id not in str(against_a.details)
        # ... and so does B's key asking the control plane for a data token for A's cache
        def token_refusal(cache_id: str) -> KcaasError:
            with pytest.raises(KcaasError) as info:
                client_b.issue_token(cache_id)
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
