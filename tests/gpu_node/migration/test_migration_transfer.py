"""Block migration between two node registries over real mutual TLS 1.3 (gpu_node/migration/transfer.py): bit-exact
copy, resume without resending verified blocks, a corrupted block refused and resent, fencing, and peer identity."""

import datetime as dt
import ssl
import threading
import time

import numpy as np
import pytest
import torch

from devtools.dev_pki import new_ca, write_node_pki
from gpu_node.agent.metrics import NodeMetrics
from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.fence import FenceTable, MovedError
from gpu_node.migration.transfer import (
    Incoming,
    MigrationError,
    MigrationListener,
    MigrationSender,
    mtls_client_context,
    mtls_server_context,
)
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

KEY = b"m" * 32
SRC, DST = "6e0de000-0000-4000-8000-0000000000a1", "6e0de000-0000-4000-8000-0000000000a2"
IDS = {"src": SRC, "dst": DST, "evil": "6e0de000-0000-4000-8000-0000000000e1"}
CAP = {"device": 0, "dram": 0, "ssd": 0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = new_ca("KCaaS platform CA (test)", valid_for=dt.timedelta(hours=1))
    other_key, other_cert = new_ca("another CA", valid_for=dt.timedelta(hours=1))
    files = {
        node: write_node_pki(directory / node, ca_key, ca_cert, IDS[node])
        for node in ("src", "dst", "evil")
        if (directory / node).mkdir() is None
    }
    (directory / "rogue").mkdir()
    files["rogue"] = write_node_pki(directory / "rogue", other_key, other_cert, SRC)  # "src", wrong CA
    return files


def server_ctx(files):
    return mtls_server_context(files["cert"], files["key"], files["ca"])


def client_ctx(files):
    return mtls_client_context(files["cert"], files["key"], files["ca"])


def two_nodes(spec, num_blocks=64, migration_id="m1"):
    capacity = dict(CAP, device=num_blocks * spec.block_bytes)
    source = CacheRegistry(device_capacity_bytes=1 << 30, device="cpu")
    target = CacheRegistry(device_capacity_bytes=1 << 30, device="cpu")
    src = source.provision(cache_id="c1", spec=spec, capacity=capacity, hash_key=KEY, epoch=1).engine
    dst = target.provision(cache_id="c1", spec=spec, capacity=capacity, hash_key=KEY, epoch=2).engine
    return source, target, src, dst


def fill(engine, spec, num_seqs=6, length=37, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 50_000, size=length).astype(np.int32) for _ in range(num_seqs)]
    seqs.append(np.concatenate([seqs[0][:20], rng.integers(0, 50_000, size=9).astype(np.int32)]))  # shares a prefix
    for tokens in seqs:
        assert engine.put(tokens, prefix_kv(spec, tokens)).num_cached_tokens == len(tokens)
    return seqs


def listener_for(target, pki, source_node=SRC, migration_id="m1", metrics=None):
    listener = MigrationListener(target, server_ctx(pki["dst"]), metrics=metrics).start()
    listener.expect(Incoming(migration_id, "c1", source_node, 2))
    return listener


def sender_for(src, listener, files, **hooks):
    return MigrationSender(
        src,
        migration_id="m1",
        cache_id="c1",
        epoch=2,
        target_endpoint=listener.endpoint,
        target_node_id=DST,
        tls_context=client_ctx(files),
        connect_timeout=2,
        **hooks,
    )


def wait_stored(listener, count, timeout=5.0):
    """The listener still takes the blocks that were on the wire when the sender was cut: wait for them."""
    deadline = time.monotonic() + timeout
    while listener.stats.blocks_stored < count and time.monotonic() < deadline:
        time.sleep(0.01)


def assert_same(dst, spec, seqs):
    for tokens in seqs:
        n, kv = dst.get(tokens)
        assert n == len(tokens)
        assert torch.equal(kv, prefix_kv(spec, tokens))  # bit-exact


@pytest.mark.parametrize("overrides", [{}, {"kv_dtype": "float16", "storage_dtype": "int8"}])
def test_copy_is_bit_exact_and_complete(pki, overrides):
    spec = tiny_spec(**overrides)
    _, target, src, dst = two_nodes(spec)
    seqs = fill(src, spec)
    listener = listener_for(target, pki)
    try:
        stats = sender_for(src, listener, pki["src"]).run()
    finally:
        listener.stop()
    for tokens in seqs:
        assert dst.get(tokens)[0] == len(tokens)
        assert torch.equal(dst.get(tokens)[1], src.get(tokens)[1])  # same stored bytes -> same KV (quantized too)
    if not overrides:
        assert_same(dst, spec, seqs)
    assert stats.blocks_sent == len(bt.snapshot(src)) == listener.stats.blocks_stored
    assert {m.key for m in bt.snapshot(dst)} == {m.key for m in bt.snapshot(src)}
    dst.check_invariants()


def test_cut_sender_resumes_without_resending_verified_blocks(pki):
    spec = tiny_spec()
    _, target, src, dst = two_nodes(spec)
    seqs = fill(src, spec)
    total = len(bt.snapshot(src))
    listener = listener_for(target, pki)
    try:
        first = sender_for(src, listener, pki["src"], cut_after_blocks=total // 2)
        with pytest.raises(MigrationError):
            first.run()
        wait_stored(listener, total // 2)
        second = sender_for(src, listener, pki["src"]).run()
    finally:
        listener.stop()
    assert first.stats.blocks_sent == total // 2
    assert not set(first.stats.keys_sent) & set(second.keys_sent)  # verified blocks are not sent again
    assert first.stats.blocks_sent + second.blocks_sent == total
    assert_same(dst, spec, seqs)


def test_cut_target_resumes_on_restarted_listener(pki):
    spec = tiny_spec()
    _, target, src, dst = two_nodes(spec)
    seqs = fill(src, spec)
    total = len(bt.snapshot(src))
    listener = listener_for(target, pki)
    try:
        first = sender_for(src, listener, pki["src"], cut_after_blocks=total // 3)
        with pytest.raises(MigrationError):
            first.run()
        wait_stored(listener, total // 3)
    finally:
        listener.stop()  # the target's listener dies; what it verified stays in its registry
    stored_before = len(bt.snapshot(dst))
    listener = listener_for(target, pki)
    try:
        second = sender_for(src, listener, pki["src"]).run()
    finally:
        listener.stop()
    assert stored_before == total // 3  # every block sent before the cut was verified and kept
    assert second.blocks_sent == total - stored_before
    assert_same(dst, spec, seqs)


def test_corrupted_block_is_refused_and_resent(pki):
    spec = tiny_spec()
    _, target, src, dst = two_nodes(spec)
    seqs = fill(src, spec)
    victim = bt.snapshot(src)[3].key
    corrupted = []

    def corrupt_once(key):
        if key == victim and not corrupted:
            corrupted.append(key)
            return True
        return False

    metrics = NodeMetrics(target)
    listener = listener_for(target, pki, metrics=metrics)
    try:
        stats = sender_for(src, listener, pki["src"], corrupt=corrupt_once).run()
    finally:
        listener.stop()
    assert corrupted == [victim]
    assert listener.stats.checksum_failures == 1
    assert metrics.registry.get_sample_value("kcaas_migration_blocks_refused_total", {"reason": "checksum"}) == 1
    migrated = {"cache": "c1", "tenant": "", "op": "migrate", "tier": "device"}
    moved = metrics.registry.get_sample_value("kcaas_node_bytes_moved_total", migrated)
    assert moved == listener.stats.bytes_stored > 0  # the stored blocks' bytes, the refused one not counted twice
    assert stats.keys_sent.count(victim) == 2  # refused, then sent again
    assert_same(dst, spec, seqs)  # never stored wrong


def test_insert_refuses_bad_checksum_and_wrong_name():
    spec = tiny_spec()
    _, _, src, dst = two_nodes(spec)
    fill(src, spec, num_seqs=1)
    meta = bt.snapshot(src)[0]
    held = bt.read_block(src, meta)
    data = bytearray(b"".join(bytes(p) for p in held.parts))
    held.release()
    bad_sum = held.checksum ^ 1
    assert bt.insert_block(dst, meta.parent, meta.key, True, meta.tokens, bad_sum, memoryview(data)) == "checksum"
    assert bt.insert_block(dst, meta.parent, b"x" * 16, True, meta.tokens, held.checksum, memoryview(data)) == "bad"
    assert bt.snapshot(dst) == []
    assert bt.insert_block(dst, meta.parent, meta.key, True, meta.tokens, held.checksum, memoryview(data)) == "stored"
    assert bt.insert_block(dst, meta.parent, meta.key, True, meta.tokens, held.checksum, memoryview(data)) == "have"
    dst.check_invariants()


@pytest.mark.parametrize("who", ["evil", "rogue"])
def test_peer_from_another_ca_or_for_another_node_is_refused(pki, who):
    spec = tiny_spec()
    _, target, src, dst = two_nodes(spec)
    fill(src, spec, num_seqs=1)
    listener = listener_for(target, pki)
    try:
        with pytest.raises((MigrationError, ssl.SSLError, OSError)):
            sender_for(src, listener, pki[who]).run()
    finally:
        listener.stop()
    assert bt.snapshot(dst) == [] and listener.stats.blocks_stored == 0


def test_sender_refuses_a_target_that_is_another_node(pki):
    spec = tiny_spec()
    _, target, src, _ = two_nodes(spec)
    listener = MigrationListener(target, server_ctx(pki["evil"])).start()
    listener.expect(Incoming("m1", "c1", SRC, 2))
    try:
        with pytest.raises(MigrationError, match="another node"):
            sender_for(src, listener, pki["src"]).run()
    finally:
        listener.stop()


def test_listener_requires_client_certificates(pki):
    spec = tiny_spec()
    _, target, _, _ = two_nodes(spec)
    loose = mtls_server_context(pki["dst"]["cert"], pki["dst"]["key"], pki["dst"]["ca"])
    loose.verify_mode = ssl.CERT_OPTIONAL
    with pytest.raises(AssertionError):
        MigrationListener(target, loose)


def test_fence_waits_for_writes_in_flight_then_answers_moved():
    fences = FenceTable()
    entered, release = threading.Event(), threading.Event()

    def writer():
        with fences.writing("c1"):
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=writer)
    thread.start()
    entered.wait(5)
    assert not fences.fence("c1", "10.0.0.2:7000", 2, timeout=0.1)  # a write is still in flight
    release.set()
    thread.join()
    assert fences.fence("c1", "10.0.0.2:7000", 2, timeout=1)
    fences.check("c1", write=False)  # reads still served while moving
    with pytest.raises(MovedError) as moved:
        fences.check("c1", write=True)
    assert (moved.value.endpoint, moved.value.epoch) == ("10.0.0.2:7000", 2)
    fences.moved("c1", "10.0.0.2:7000", 2)
    with pytest.raises(MovedError):
        fences.check("c1", write=False)
    fences.lift("c1")
    assert fences.is_moved("c1") == ("10.0.0.2:7000", 2)  # a moved cache stays moved
