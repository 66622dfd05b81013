"""A PUT whose KV the cache's storage cannot hold (gpu_node/engine/kv_input.py: NaN/inf into int8, a finite value beyond
a narrower float storage) is answered `bad_request` with the engine's message, not `internal`; nothing of that
sequence is stored and the connection keeps working."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcaas import wire
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from kcaas.wire import ErrorCode, Opcode
from tests.gpu_node.dataplane.conftest import EPOCH
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

TOKENS = np.arange(1000, 1010, dtype=np.int32)
OTHER = np.arange(50, 56, dtype=np.int32)


@pytest.fixture
def int8_cache(registry):
    spec = tiny_spec(storage_dtype="int8")
    registry.provision(
        cache_id="c_int8", spec=spec, capacity={"device": 64 * spec.block_bytes}, hash_key=b"q" * 32, epoch=EPOCH
    )
    return "c_int8", spec, registry.get("c_int8").engine


def said_hello(raw, make_token, cache_id):
    conn = raw()
    assert conn.hello(make_token(cache_id), cache_id=cache_id).opcode == Opcode.OK
    return conn


def _bytes(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.contiguous().numpy()).cast("B")


def test_non_finite_kv_put_is_a_bad_request_and_the_connection_keeps_working(server, make_token, raw, int8_cache):
    cache_id, spec, engine = int8_cache
    conn = said_hello(raw, make_token, cache_id)
    kv = prefix_kv(spec, TOKENS)
    kv[1, 0, 7, 1, 2] = float("nan")
    reply = conn.request(Opcode.PUT, TOKENS, cache_id=cache_id, identity=spec, kv=_bytes(kv))
    assert reply.opcode == Opcode.ERROR
    assert reply.meta["code"] == ErrorCode.BAD_REQUEST
    assert "non-finite" in reply.meta["message"] and "[layer 1, K, token 7, head 1, dim 2]" in reply.meta["message"]
    assert reply.meta["details"] == {"reason": "kv_not_storable", "sequence": 0}
    assert engine.lookup(TOKENS) == 0 and engine.stats().num_used_blocks == 0
    # the same connection: a lookup and a good put are answered
    assert conn.request(Opcode.LOOKUP, TOKENS, cache_id=cache_id, identity=spec).opcode == Opcode.OK
    good = conn.request(Opcode.PUT, TOKENS, cache_id=cache_id, identity=spec, kv=_bytes(prefix_kv(spec, TOKENS)))
    assert good.opcode == Opcode.OK and good.meta["num_cached"] == [10]
    assert engine.lookup(TOKENS) == 10


def test_batch_put_names_the_refused_sequence(server, make_token, raw, int8_cache):
    cache_id, spec, engine = int8_cache
    conn = said_hello(raw, make_token, cache_id)
    bad = prefix_kv(spec, TOKENS)
    bad[0, 1, 0, 0, 0] = float("-inf")
    conn.rid += 1
    conn.send(
        wire.encode_request(
            Opcode.PUT_BATCH,
            conn.rid,
            cache_id=cache_id,
            identity=spec,
            token_ids=[OTHER, TOKENS],
            kv=[_bytes(prefix_kv(spec, OTHER)), _bytes(bad)],
        )
    )
    reply = conn.read()
    assert reply.opcode == Opcode.ERROR and reply.meta["code"] == ErrorCode.BAD_REQUEST
    assert reply.meta["details"] == {"reason": "kv_not_storable", "sequence": 1}
    assert engine.lookup(OTHER) == len(OTHER)  # sequences are put in order: the one before was stored
    assert engine.lookup(TOKENS) == 0


def test_sdk_client_gets_a_dataplane_error_with_the_code(server, make_token, client_ctx, registry):
    spec = tiny_spec(storage_dtype="float16")  # fp32 KV in fp16 storage: 1e6 would be stored as inf
    registry.provision(
        cache_id="c_fp16", spec=spec, capacity={"device": 64 * spec.block_bytes}, hash_key=b"h" * 32, epoch=EPOCH
    )
    kv = prefix_kv(spec, TOKENS)
    kv[0, 0, 3, 0, 0] = 1e6
    with DataPlaneClient(server.endpoint, make_token("c_fp16"), "c_fp16", spec, ssl_context=client_ctx) as dp:
        with pytest.raises(DataPlaneError) as info:
            dp.put(TOKENS, kv)
        assert info.value.code == ErrorCode.BAD_REQUEST and "beyond float16" in str(info.value)
        assert dp.lookup(TOKENS) == 0
        kv[0, 0, 3, 0, 0] = 1.0
        assert dp.put(TOKENS, kv)["num_cached"] == 10
        n, got = dp.get(TOKENS)
        assert n == 10 and torch.equal(got, kv.half().float())
    assert server.connection_count() <= 1
