"""kcaas.kv_events against vLLM's own event structs (the vLLM venv's msgspec encoder and typed decoder,
tests/e2e/vllm_events.py): what vLLM encodes, KCaaS reads and writes back byte for byte, and what KCaaS writes,
vLLM's decoder reads as the same events: a vLLM-event consumer reads KCaaS's events unchanged."""

import json
import subprocess

from kcaas.kv_events import decode_batch, encode_batch
from tests.e2e.vllm_support import REPO, requires_vllm, runner_env, vllm_python

pytestmark = requires_vllm
EVENTS = [
    {
        "type": "BlockStored",
        "block_hashes": [2**63 + 5, 456],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "medium": "GPU",
        "extra_keys": [None, ["my-lora", "salt"]],
    },
    {
        "type": "BlockStored",
        "block_hashes": [789],
        "parent_block_hash": 456,
        "token_ids": [9, 9, 9, 9],
        "block_size": 4,
        "medium": "CPU",
        "lora_name": "my-lora",
    },
    {"type": "BlockRemoved", "block_hashes": [456], "medium": "GPU"},
    {"type": "AllBlocksCleared"},
]


def vllm(command: str, stdin: str) -> str:
    done = subprocess.run(
        [vllm_python(), str(REPO / "tests" / "e2e" / "vllm_events.py"), command],
        input=stdin,
        capture_output=True,
        text=True,
        env=runner_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_vllms_batches_read_and_write_back_byte_for_byte_and_vllm_reads_ours():
    payload = bytes.fromhex(vllm("encode", json.dumps(EVENTS)))
    batch = decode_batch(payload)
    stored, chained, removed, cleared = batch.events
    assert stored.block_hashes == (2**63 + 5, 456) and stored.extra_keys == (None, ("my-lora", "salt"))
    assert chained.parent_block_hash == 456 and chained.medium == "CPU" and chained.lora_name == "my-lora"
    assert removed.block_hashes == (456,) and type(cleared).__name__ == "AllBlocksCleared"
    assert encode_batch(batch) == payload

    read_by_vllm = json.loads(vllm("decode", encode_batch(batch).hex()))
    assert [e["type"] for e in read_by_vllm["events"]] == [e["type"] for e in EVENTS]
    assert read_by_vllm["events"][0]["block_hashes"] == [2**63 + 5, 456]
    assert read_by_vllm["events"][1]["token_ids"] == [9, 9, 9, 9] and read_by_vllm["events"][1]["medium"] == "CPU"
