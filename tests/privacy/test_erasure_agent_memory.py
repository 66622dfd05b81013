"""Erasure leaves no plaintext KV in a node agent's memory. A real agent process (TLS data plane) takes one tenant's
KV through every data-plane path that stages bytes, each with its own 64-byte pattern: a put into the connection's
staging buffer, a put of a suffix whose cached prefix is read back and joined, a put read ahead while the staging
is busy (a fresh buffer), a frame read whole into the decoder's read buffer, a get answered from the pool, a put
on a second connection. The tenant is erased through the real path (API -> job -> purge order over the broker ->
the node's answer) while its connections are still open; then no pattern is anywhere in the agent's writable
memory (/proc/<pid>/maps + /proc/<pid>/mem): not in the pool (zeroed), nor in the freed heap, thread arenas, thread
stacks or anonymous mappings where staging buffers, temporaries, the decoder's buffer or OpenSSL's record buffers
lived; with the network tier, not in the sealed copies or the store client's buffers either, and the erasure
removes the tenant's objects from the store. The agent runs with glibc's allocator at its most retentive
(GLIBC_TUNABLES): freed memory stays mapped, so a buffer released unzeroed is found, whatever its size — the
engine's own write temporaries included (the suffix put's uncached slice is reshaped into a temporary by the CPU
scatter)."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
import pytest
import torch

from core.celery import app as control_app
from devtools.dev_pki import write_dev_pki
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec
from kcaas.wire import Opcode
from privacy import services
from tests.caches.conftest import SPEC, attach_body, running_workers, wait_for_state
from tests.e2e.conftest import AgentLauncher, client_tls
from tests.privacy import memory_scan
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

LAYOUT = KVCacheSpec.from_dict(SPEC)
BLOCK_TOKENS = LAYOUT.block_size
BIG = 640 * BLOCK_TOKENS  # 10240 tokens: 1.25 MiB of KV


# The allocator at its most retentive: every allocation below 32 MiB from an arena, freed memory never given back to
# the kernel (no mmap'd chunk that munmap would hide, no trimming), so a buffer released unzeroed stays readable.
RETAINING_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


@pytest.fixture(params=["node tiers", "network tier"])
def agent(request, live_server, tmp_path, monkeypatch, settings):
    """The agent; with "network tier", pointed at the fleet's store (the tenant's cache then writes its blocks
    through to it: sealed copies, the store client's buffers)."""
    monkeypatch.setenv("GLIBC_TUNABLES", RETAINING_MALLOC)
    if request.param == "network tier":
        settings.KCAAS_NETWORK_STORE_BYTES = 1 << 30
        for name, value in request.getfixturevalue("network_store").env().items():
            monkeypatch.setenv(name, value)
    (tmp_path / "pki").mkdir()
    pki = write_dev_pki(tmp_path / "pki", server_name="memory-scan node")
    with running_workers((control_app, ["control"])):
        launcher = AgentLauncher(live_server.url, pki, 4096 * LAYOUT.block_bytes, tmp_path)
        try:
            store = request.getfixturevalue("network_store") if request.param == "network tier" else None
            yield launcher.start(), pki, store
        finally:
            launcher.close()


def pattern_kv(pattern: bytes, num_tokens: int) -> torch.Tensor:
    """KV of `num_tokens` whose bytes are `pattern` over and over (a whole number of patterns per token run)."""
    nbytes = num_tokens * LAYOUT.kv_bytes_per_token
    data = bytearray(pattern * (nbytes // len(pattern)))
    shape = (LAYOUT.num_layers, 2, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.frombuffer(data, dtype=torch.float16).view(shape)


def tokens_from(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def frame_bytes(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def put_frame(rid: int, cache_id: str, tokens: np.ndarray, kv: torch.Tensor, start: int = 0) -> bytes:
    kv_bytes = kv[:, :, start:].contiguous().view(torch.uint8).reshape(-1).numpy()
    return frame_bytes(
        wire.encode_request(
            Opcode.PUT, rid, cache_id=cache_id, identity=LAYOUT, token_ids=[tokens], kv=[kv_bytes], kv_start=[start]
        )
    )


class RawTls:
    """Hand-made frames on one TLS connection: what the SDK never sends (two puts in one write, a put of a suffix)."""

    def __init__(self, endpoint: str, pki):
        host, _, port = endpoint.rpartition(":")
        self.sock = client_tls(pki).wrap_socket(
            socket.create_connection((host, int(port)), timeout=20), server_hostname=host
        )
        self.decoder = wire.FrameDecoder()

    def read(self) -> wire.Frame:
        while (frame := self.decoder.next_frame()) is None:
            data = self.sock.recv(1 << 16)
            assert data, "the node closed the connection"
            self.decoder.feed(data)
        return frame


def random_pattern(seed: int) -> bytes:
    """64 bytes of finite fp16 values: 32 elements, so every token's run of KV holds whole patterns."""
    return torch.randn(32, generator=torch.Generator().manual_seed(seed)).to(torch.float16).numpy().tobytes()


PATHS = ("staged put", "suffix put", "pipelined put", "pipelined put read ahead", "put read whole", "small staged put")
SMALL = 48 * BLOCK_TOKENS  # 96 KiB of KV
READ_AHEAD = 40 * BLOCK_TOKENS  # 80 KiB: a size no later buffer reuses exactly


def send_every_staging_path(endpoint: str, pki, cache_id: str, token: str, patterns: dict) -> list:
    """Puts (and a get) of KV made of one pattern per staging path; returns the connections, left open."""
    first = tokens_from(0, BIG)
    sdk = DataPlaneClient(endpoint, token, cache_id, LAYOUT, ssl_context=client_tls(pki), timeout=20)
    assert sdk.put(first, pattern_kv(patterns["staged put"], BIG))["num_written"] == BIG  # the staging buffer
    raw = RawTls(endpoint, pki)
    raw.sock.sendall(frame_bytes(wire.encode_hello(1, cache_id=cache_id, token=token)))
    assert raw.read().opcode == Opcode.OK
    longer = tokens_from(0, BIG + 4 * BLOCK_TOKENS)  # the first put's tokens and 4 blocks more: KV of the suffix only
    raw.sock.sendall(put_frame(2, cache_id, longer, pattern_kv(patterns["suffix put"], len(longer)), start=BIG))
    answer = raw.read()
    assert answer.opcode == Opcode.OK and answer.meta["num_cached"] == [len(longer)], answer.meta
    # a small put and a larger one in one write: the larger one's metadata is read with the small one's last bytes,
    # before the small one is handled, so its KV goes into a fresh buffer (the staging is the small one's)
    small, ahead = tokens_from(100_000, 2 * BLOCK_TOKENS), tokens_from(200_000, READ_AHEAD)
    raw.sock.sendall(
        put_frame(3, cache_id, small, pattern_kv(patterns["pipelined put"], len(small)))
        + put_frame(4, cache_id, ahead, pattern_kv(patterns["pipelined put read ahead"], READ_AHEAD))
    )
    assert [raw.read().opcode, raw.read().opcode] == [Opcode.OK, Opcode.OK]
    one_block = tokens_from(400_000, BLOCK_TOKENS)  # a frame read whole into the decoder's read buffer, last
    raw.sock.sendall(put_frame(5, cache_id, one_block, pattern_kv(patterns["put read whole"], BLOCK_TOKENS)))
    assert raw.read().opcode == Opcode.OK
    n, kv = sdk.get(longer)  # an answer straight from the pool
    assert n == len(longer) and kv[:, :, BIG:].numpy().tobytes()[:64] == patterns["suffix put"]
    other = DataPlaneClient(endpoint, token, cache_id, LAYOUT, ssl_context=client_tls(pki), timeout=20)
    assert other.put(tokens_from(300_000, SMALL), pattern_kv(patterns["small staged put"], SMALL))["num_written"]
    return [sdk, raw, other]


def store_allocated_bytes(store) -> int:
    """The bytes the network store's master reports allocated (0 without a store)."""
    if store is None:
        return 0
    with urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("master_allocated_bytes "):
                return int(float(line.split()[1]))
    raise AssertionError("the store's master reports no master_allocated_bytes")


def scan(pid: int, patterns: dict) -> dict[str, list[str]]:
    """Where each path's pattern is in the agent's memory (described), for the paths where it is."""
    found = {}
    for path, pattern in patterns.items():
        hits = memory_scan.find_bytes(pid, pattern)
        if hits:
            found[path] = [memory_scan.describe(pid, hit, pattern) for hit in hits[:3]]
    return found


def test_an_erased_tenants_kv_is_nowhere_in_the_agents_memory(agent, tenant_a, staff_client, no_grace):
    process, pki, network = agent  # network: the store's endpoints, or None
    pid = process.process.pid
    # the scan is the proof: where it cannot read the agent the test fails rather than passing unproven
    assert memory_scan.readable(pid), "this process may not read the agent's memory (/proc/<pid>/mem: root or ptrace)"
    body = attach_body("memory", device=3072 * LAYOUT.block_bytes)
    if network:  # every put's full blocks are sealed and stored before it is acknowledged
        body["capacity"]["network"] = 4096 * LAYOUT.block_bytes
        body["network_write_through"] = True
    response = tenant_a.client.post("/api/v1/caches", body, format="json")
    assert response.status_code == 201, response.content
    cache = wait_for_state(tenant_a.client, response.json()["id"], "ready", timeout=30)
    token = tenant_a.client.post(f"/api/v1/caches/{cache['id']}/tokens", {"access": "readwrite"}, format="json")
    patterns = {path: random_pattern(seed) for seed, path in enumerate(PATHS)}
    stored_before = store_allocated_bytes(network)
    connections = send_every_staging_path(cache["endpoint"], pki, cache["id"], token.json()["token"], patterns)
    if network:  # written through: the store holds (at least) the first put's blocks
        assert store_allocated_bytes(network) - stored_before >= BIG // BLOCK_TOKENS * LAYOUT.block_bytes
    assert set(scan(pid, patterns)) == set(PATHS), "the scan does not see the KV the agent holds"

    tenant_id = tenant_a.tenant.pk
    assert staff_client.post(f"/api/v1/admin/tenants/{tenant_id}/erasure").status_code == 201
    services.erasures_run_due()
    erasure = lambda: staff_client.get(f"/api/v1/admin/tenants/{tenant_id}/erasure").json()  # noqa: E731
    assert eventually(lambda: erasure()["state"] == "complete", timeout=30), erasure()

    if network:  # the erasure removed the tenant's objects from the store
        assert eventually(lambda: store_allocated_bytes(network) <= stored_before, timeout=10)
    left = scan(pid, patterns)
    assert left == {}, f"plaintext KV of the erased tenant survives in the agent: {left}"
    with open(f"/proc/{pid}/environ", "rb") as environ:  # it re-executed itself: no lazy binding spills registers
        assert b"LD_BIND_NOW=1" in environ.read().split(b"\0")
    for connection in connections:
        connection.sock.close() if isinstance(connection, RawTls) else connection.close()
