"""vLLM's own KV-event code for the tests, run by the vLLM venv's interpreter (KCAAS_VLLM_PYTHON), never imported by
the main venv's pytest:

    $KCAAS_VLLM_PYTHON tests/e2e/vllm_events.py encode < events.json     # one hex line: vLLM's msgspec encoding
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_events.py decode < payload.hex     # one JSON line: what vLLM's decoder reads
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_events.py publish PUB REPLAY HEALTH_PORT
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_events.py consume PUB REPLAY N    # N batches, then a replay from seq 0

events.json is one JSON line, a list of events: {"type": "BlockStored", "block_hashes": [...], "parent_block_hash":
..., "token_ids": [...], "block_size": n, "medium": "GPU", "extra_keys": [...] | null} | {"type": "BlockRemoved",
"block_hashes": [...], "medium": ...} | {"type": "AllBlocksCleared"}.

`consume` reads a publisher as vLLM-event consumers do (a SUB socket, frames `(topic, seq, payload)` decoded by vLLM's
typed msgspec decoder into KVEventBatch; what it missed, from the ROUTER replay socket), prints {"ready": true} once
connected, then one JSON line per batch in seq order (`{"seq", "events": [{"type", "block_hashes", "token_ids"?,
...}]}`) until N arrived, then asks the replay socket for every batch from seq 0 and prints `{"replayed": [seqs]}`.

`publish` runs vllm.distributed.kv_events.ZmqEventPublisher (vLLM's own publisher, with its replay buffer) on the
PUB and ROUTER endpoints, and an HTTP server answering GET /health on HEALTH_PORT (what vLLM's OpenAI server
answers there); it prints {"ready": true}, then reads one JSON line per batch from stdin (a list of events as above)
and publishes it, printing {"published": seq}; "exit" or EOF ends it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _event(raw: dict):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    kind = raw["type"]
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=raw["block_hashes"],
            parent_block_hash=raw.get("parent_block_hash"),
            token_ids=raw["token_ids"],
            block_size=raw["block_size"],
            lora_id=None,
            medium=raw.get("medium", "GPU"),
            lora_name=raw.get("lora_name"),
            extra_keys=raw.get("extra_keys"),
            group_idx=0,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=raw["block_hashes"], medium=raw.get("medium", "GPU"), group_idx=0)
    return AllBlocksCleared()


def _batch(events: list[dict]):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=time.time(), events=[_event(e) for e in events])


def encode() -> None:
    import msgspec

    print(msgspec.msgpack.encode(_batch(json.loads(sys.stdin.readline()))).hex())


def decode() -> None:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()), type=KVEventBatch)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    print(json.dumps({"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}, default=repr))


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def publish(pub: str, replay: str, health_port: int) -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    server = ThreadingHTTPServer(("127.0.0.1", health_port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=pub, replay_endpoint=replay)
    print(json.dumps({"ready": True}), flush=True)
    seq = 0
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        publisher.publish(_batch(json.loads(line)))
        print(json.dumps({"published": seq}), flush=True)
        seq += 1
    publisher.shutdown()
    server.shutdown()


def consume(pub: str, replay: str, count: int) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    print(json.dumps({"ready": True}), flush=True)

    def replayed_from(first: int) -> list[tuple[int, bytes]]:
        """vLLM's replay protocol: every kept batch from `first`, then END_SEQ."""
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        batches = []
        while (frames := dealer.recv_multipart())[2] != (-1).to_bytes(8, "big", signed=True):
            batches.append((int.from_bytes(frames[2], "big"), frames[3]))
        return batches

    def show(seq: int, payload: bytes) -> None:
        events = []
        for event in decoder.decode(payload).events:
            fields = msgspec.structs.asdict(event)
            fields["block_hashes"] = [h.hex() if isinstance(h, bytes) else h for h in fields.get("block_hashes", [])]
            events.append({"type": type(event).__name__, **fields})
        print(json.dumps({"seq": seq, "events": events}, default=repr), flush=True)

    # What a consumer that joined late missed (ZMQ delivers only after its subscription arrived) it asks the
    # replay socket for: at a gap in the seqs, and whenever the stream is quiet.
    next_seq = 0
    while next_seq < count:
        if sub.poll(100):
            _, seq_bytes, payload = sub.recv_multipart()
            arrived = [(int.from_bytes(seq_bytes, "big"), payload)]
            if arrived[0][0] > next_seq:
                arrived = replayed_from(next_seq)
        else:
            arrived = replayed_from(next_seq)
        for seq, payload in arrived:
            if seq == next_seq and next_seq < count:
                show(seq, payload)
                next_seq += 1
    print(json.dumps({"replayed": [seq for seq, payload in replayed_from(0) if decoder.decode(payload)]}), flush=True)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "encode":
        encode()
    elif command == "decode":
        decode()
    elif command == "publish":
        publish(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif command == "consume":
        consume(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")
