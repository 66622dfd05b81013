"""kcaas.kv_events: vLLM's KV event batches read and written (byte-for-byte against vLLM's own encoder in
tests/e2e/test_vllm_kv_events.py); here, what is not a batch is refused whole, with a reason."""

import msgpack
import pytest

from kcaas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    decode_batch,
    encode_batch,
)

STORED = {
    "type": "BlockStored",
    "block_hashes": [1, 2],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


def test_a_batch_round_trips_and_a_two_element_batch_reads_too():
    batch = EventBatch(
        1.5,
        (
            BlockStored((1, b"\x02"), 7, tuple(range(8)), 4, "CPU", extra_keys=(None, ("s",))),
            BlockRemoved((1,), "GPU"),
            AllBlocksCleared(),
        ),
    )
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(msgpack.packb([2.0, [STORED]])).events[0].block_hashes == (1, 2)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1}), "a batch is"),
        (msgpack.packb([1.0, [{"type": "Nope"}]]), "unknown event type"),
        (msgpack.packb([1.0, [{**STORED, "token_ids": [1, 2, 3]}]]), "block_size tokens"),
        (msgpack.packb([1.0, [{**STORED, "medium": 7}]]), "a medium is a name"),
        (msgpack.packb([1.0, [{**STORED, "medium": "M" * 17}]]), "a medium is a name"),
        (msgpack.packb([1.0, [{**STORED, "block_hashes": [None]}]]), "may not be null"),
        (msgpack.packb([1.0, [{k: v for k, v in STORED.items() if k != "token_ids"}]]), "without"),
        (msgpack.packb([1.0, [{**STORED, "token_ids": ["a"] * 8}]]), "integer"),
        (msgpack.packb([1.0, ["BlockStored"]]), "tagged"),
    ],
)
def test_what_is_not_a_batch_is_refused_with_a_reason(raw, reason):
    with pytest.raises(EventFormatError, match=reason):
        decode_batch(raw)
