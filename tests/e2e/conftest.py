"""Fixtures that run the whole service with real processes (shared by the tests/e2e/test_service_*.py modules):

- `model` / `spec_for`: a tiny random Llama (float32) and the cache layout that matches it;
- `pki` / `client_tls`: a throwaway CA and a server certificate for 127.0.0.1 (TLS 1.3 only on the client side);
- `tenant_dataplane`: a cache's data-plane client as its tenant (refreshing tokens, trusting the test CA);
- `control_worker`: the control queue's Celery worker (a thread, over the real Redis broker);
- `agent_launcher`: starts node agent PROCESSES (python -m gpu_node.agent) serving TLS on an ephemeral port; a
  handle can be SIGKILLed and the node restarted with the same credential and endpoint (`launcher.restart`);
- `agent`: one agent started by the launcher;
- `tenant_key()`: a fresh tenant (rate limit lifted) and an API key with caches:read/write;
- `RawConnection`: a plain ssl+socket connection speaking kcaas.wire frames by hand, for hostile clients that the
  SDK would never let a test build (forged HELLOs, half-sent PUTs), answering with the exact bytes the node sent.

The control plane is pytest-django's live_server: a thread of the test process, so `settings` overrides reach it.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from core.celery import app as control_app
from devtools.dev_pki import write_dev_pki
from fleet import services as fleet_services
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec
from kcaas.tokens import TokenSource
from tenants import services as tenant_services
from tests.caches.conftest import free_port, purge_node_queue, running_workers

REPO = Path(__file__).resolve().parents[2]


# ---- the model -------------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_exported_kcaas_target(monkeypatch):
    """A developer's shell may hold the README's `export KCAAS_URL=... KCAAS_API_KEY=...`: make up would then listen
    on that URL's port and the demo use that key, not the port and key each test chooses for the processes it
    starts."""
    for name in ("KCAAS_URL", "KCAAS_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def deterministic_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # with eager attention: the model's own arithmetic is bit-stable across lengths
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def model_prefix(model, donor: torch.Tensor, num_tokens: int):
    """The cache a served run starts from, made by the model alone (no store, no service): the KV of `donor`'s first
    `num_tokens` tokens from one forward over `donor` (as the connector stored it), in a full-length DynamicCache.

    A served run is compared bit for bit with the model given this cache: the same computation, so any difference
    is the service's. Against a run with no cache at all (one prefill over the whole prompt) it agrees only to fp32
    rounding: a prefill of the last few rows takes other matmul kernels than one of every row, and whether those
    round alike depends on the CPU and the BLAS build (bit-equal on some machines, ~1e-7 apart on others)."""
    from kcaas.transformers_kv import full_length_cache, kv_from_dynamic_cache

    with torch.no_grad():
        kv = kv_from_dynamic_cache(model(donor, cache=full_length_cache(), use_cache=True).cache)
    return full_length_cache(kv[:, :, :num_tokens].contiguous())


FP32_ROUNDING = dict(rtol=0, atol=1e-5)  # a wrong prefix is off by about the logits themselves (~0.5)


def spec_for(model) -> KVCacheSpec:
    c = model.config
    return KVCacheSpec(
        "tiny-llama-random@seed0",
        c.num_hidden_layers,
        c.num_key_value_heads,
        c.hidden_size // c.num_attention_heads,
        16,
        "float32",
        "float32",
    )


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def random_kv(spec: KVCacheSpec, n: int, seed: int) -> torch.Tensor:
    """KV of n tokens in the engine layout [num_layers, 2, n, num_kv_heads, head_dim]: distinct bytes per seed."""
    shape = (spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


# ---- PKI -------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (PEM files), valid for an hour."""
    return write_dev_pki(tmp_path_factory.mktemp("e2e-pki"), server_name="e2e node")


def client_tls(pki) -> ssl.SSLContext:
    """Trusts only the test CA (TLS 1.3, hostname checked against the certificate's 127.0.0.1 SAN)."""
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def tenant_dataplane(
    client, cache, spec: KVCacheSpec, pki, *, access: str = "readwrite", timeout: float = 10.0
) -> DataPlaneClient:
    """A data-plane client of `cache` as its tenant: refreshing tokens from `client`, trusting only the test CA."""
    return DataPlaneClient(
        cache.endpoint,
        TokenSource(client, cache.id, access=access),
        cache.id,
        spec,
        ssl_context=client_tls(pki),
        timeout=timeout,
    )


# ---- processes -------------------------------------------------------------------------------------------------------


@pytest.fixture
def control_worker():
    with running_workers((control_app, ["control"])) as (worker,):
        yield worker


@dataclass
class AgentProcess:
    """One agent process of a node. `kill()` is SIGKILL: no stop step runs, the pools die with the process."""

    node_id: uuid.UUID
    credential: str
    endpoint: str
    process: subprocess.Popen
    stderr_path: Path

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class AgentLauncher:
    """Starts agent processes against the live server; every process it started is killed at teardown."""

    control_url: str
    pki: dict[str, str]
    device_bytes: int
    workdir: Path
    started: list[AgentProcess] = field(default_factory=list)
    _files: list = field(default_factory=list)

    def start(self) -> AgentProcess:
        """A new node (fresh credential) and its agent, serving TLS 1.3 on an ephemeral port."""
        issued = fleet_services.node_create(name=f"e2e-node-{uuid.uuid4().hex[:6]}")
        return self._spawn(issued.node.pk, issued.credential, f"127.0.0.1:{free_port()}")

    def restart(self, previous: AgentProcess) -> AgentProcess:
        """The same node again (same credential, same endpoint) after its process died; it re-registers."""
        assert not previous.alive, "kill() the agent before restarting its node"
        return self._spawn(previous.node_id, previous.credential, previous.endpoint)

    def _spawn(self, node_id, credential: str, endpoint: str) -> AgentProcess:
        env = {
            **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
            "KCAAS_CONTROL_URL": self.control_url,
            "KCAAS_NODE_CREDENTIAL": credential,
            "KCAAS_NODE_ENDPOINT": endpoint,
            "KCAAS_NODE_DEVICE_BYTES": str(self.device_bytes),
            "KCAAS_NODE_TORCH_DEVICE": "cpu",
            "KCAAS_NODE_TLS_CERT": self.pki["cert"],
            "KCAAS_NODE_TLS_KEY": self.pki["key"],
            "KCAAS_NODE_METRICS_PORT": str(free_port()),
            "LOG_LEVEL": "WARNING",
        }
        stderr_path = self.workdir / f"agent-{len(self.started)}.stderr"
        stderr = open(stderr_path, "w+")  # a file, not a pipe: a chatty agent can never block on it
        self._files.append(stderr)
        process = subprocess.Popen(
            [sys.executable, "-m", "gpu_node.agent"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        handle = AgentProcess(uuid.UUID(str(node_id)), credential, endpoint, process, stderr_path)
        self.started.append(handle)
        self._files.append(process.stdout)
        line = process.stdout.readline()
        if "ready" not in line:
            handle.kill()
            pytest.fail(f"agent did not start: {line!r} {stderr_path.read_text()[-3000:]}")
        return handle

    def close(self) -> None:
        for handle in self.started:
            handle.kill()
        for f in self._files:
            f.close()
        for node_id in {handle.node_id for handle in self.started}:
            purge_node_queue(node_id)


@pytest.fixture
def agent_launcher(live_server, control_worker, pki, tmp_path, model):
    launcher = AgentLauncher(live_server.url, pki, 512 * spec_for(model).block_bytes, tmp_path)
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
def agent(agent_launcher) -> AgentProcess:
    """A real agent process serving TLS 1.3 on an ephemeral port; killed (and its queue purged) afterwards."""
    return agent_launcher.start()


def tenant_key() -> str:
    tenant = tenant_services.tenant_create(name=f"e2e-tenant-{uuid.uuid4().hex[:8]}")
    tenant_services.quota_update(tenant=tenant, max_requests_per_second=100_000)
    return tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read", "caches:write"]).raw_key


# ---- a hand-made wire client -----------------------------------------------------------------------------------------


class RawConnection:
    """ssl + socket and kcaas.wire encoders, nothing of the SDK: sends any bytes, reads answers frame by frame.

    `exchange(buffers)` sends one request and returns (frame, raw_bytes) of the node's answer; `raw_bytes` is the
    answer exactly as it crossed the wire (header + metadata + payload), for byte-for-byte comparisons.
    """

    def __init__(self, endpoint: str, pki, *, timeout: float = 10.0):
        host, _, port = endpoint.rpartition(":")
        raw = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock = client_tls(pki).wrap_socket(raw, server_hostname=host)
        assert self.sock.version() == "TLSv1.3"
        self._next_id = 0

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send(self, buffers) -> None:
        for buf in buffers:
            self.sock.sendall(buf)

    def _recv_exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError(f"the node closed the connection ({n - left} of {n} bytes read)")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def read_frame(self) -> tuple[wire.Frame, bytes]:
        head = self._recv_exactly(wire.HEADER_SIZE)
        _, _, _, _, _, metadata_len, _, payload_len = wire.HEADER.unpack(head)
        raw = head + self._recv_exactly(metadata_len + payload_len)
        return wire.decode_frame(raw), raw

    def exchange(self, buffers) -> tuple[wire.Frame, bytes]:
        self.send(buffers)
        return self.read_frame()

    def hello(self, cache_id: str, token: str, *, request_id: int = 1) -> tuple[wire.Frame, bytes]:
        return self.exchange(wire.encode_hello(request_id, cache_id=cache_id, token=token))

    def closed(self) -> bool:
        """Whether the node has closed the connection (a read gets end of stream or a reset, not a timeout)."""
        self.sock.settimeout(0.2)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def error_of(frame: wire.Frame) -> wire.ErrorReply:
    """The ERROR a frame carries (fails the test on anything else: an OK would be a leak)."""
    assert frame.opcode == wire.Opcode.ERROR, f"expected a refusal, got {frame.opcode.name} {frame.meta}"
    return wire.parse_response(frame, request_opcode=wire.Opcode.HELLO)
