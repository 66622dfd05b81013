"""A cache's block events re-published over ZMQ on the loopback, exactly as a vLLM engine publishes its own (PUB
frames `(topic, seq, payload)` and a ROUTER replay socket), for consumers that read vLLM's KV events (Dynamo's KV
router and kv_indexer, llm-d's precise prefix-cache scorer):

    KCAAS_API_KEY=kc_live_... python -m kcaas.events_bridge --cache chat --ca-file var/secrets/dev-ca.pem \\
        --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558

The events come from the node over the TLS data plane (DataPlaneClient.events, the cache's read token); the bridge
hands the node's batches on unchanged, with the node's sequence numbers. ZMQ here is plain TCP: bind it to the
loopback (the default; another address is refused unless --allow-non-loopback), where only this host's processes
read it. A gap the node could not fill (its log dropped batches) is published as an AllBlocksCleared batch, so
consumers start over instead of holding stale blocks. Needs pyzmq.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from kcaas.kv_events import END_SEQ, AllBlocksCleared, EventBatch, encode_batch

logger = logging.getLogger("kcaas.events_bridge")
REPLAY_KEEP = 10_000  # batches kept for the replay socket (vLLM's buffer_steps default)


class EventsBridge:
    """Polls a cache's events and re-publishes them (one instance per cache)."""

    def __init__(self, dataplane, endpoint: str, replay_endpoint: str | None, *, poll_s: float = 0.2, topic: str = ""):
        import zmq

        self._dp, self._poll_s, self._topic = dataplane, poll_s, topic.encode()
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_KEEP)
        self.next_seq = 0  # the node's next batch to read

    def step(self) -> int:
        """Read what the node has since the last step and publish it; answer waiting replay requests. Returns the
        batches published."""
        answer = self._dp.events(self.next_seq, max_batches=512)
        published = 0
        if answer.missed:  # the node dropped batches this bridge never read: consumers start over
            self._publish(answer.first_seq - 1, encode_batch(EventBatch(time.time(), (AllBlocksCleared(),))))
        for seq, batch in answer.batches:
            self._publish(seq, encode_batch(batch))
            published += 1
        self.next_seq = answer.next_seq
        self._serve_replays()
        return published

    def _publish(self, seq: int, payload: bytes) -> None:
        if seq < 0:
            return
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._kept.append((seq, payload))

    def _serve_replays(self) -> None:
        import zmq

        while self._replay is not None and self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._kept:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def run(self, stop) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the node or the network: try again, never die
                logger.warning("events bridge: cannot read the cache's events (%s); retrying", exc)
            stop.wait(self._poll_s)

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def check_loopback(endpoint: str) -> None:
    """Raises ValueError unless `endpoint` binds a loopback address (events carry the tenant's token ids)."""
    host = urlsplit(endpoint).hostname or ""
    try:
        loopback = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{endpoint} is not a loopback address: its frames travel in clear (--allow-non-loopback)")


def main(argv: list[str] | None = None) -> int:
    import threading

    import kcaas
    from kcaas.dataplane import DataPlaneClient
    from kcaas.tls import dataplane_ssl_context

    parser = argparse.ArgumentParser(prog="python -m kcaas.events_bridge", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("KCAAS_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--cache", required=True, help="the cache's name or id")
    parser.add_argument("--ca-file", help="the CA the node's certificate chains to (make up: var/secrets/dev-ca.pem)")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    parser.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558")
    parser.add_argument("--allow-non-loopback", action="store_true")
    args = parser.parse_args(argv)
    key = os.environ.get("KCAAS_API_KEY")
    if not key:
        parser.error("set KCAAS_API_KEY (a key with caches:read)")
    if not args.allow_non_loopback:
        for endpoint in (args.endpoint, args.replay_endpoint):
            try:
                check_loopback(endpoint)
            except ValueError as exc:
                parser.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    client = kcaas.Client(args.url, key)
    cache = next((c for c in client.list_caches() if args.cache in (c.id, c.name) and c.is_ready), None)
    if cache is None:
        parser.error(f"no ready cache {args.cache!r} for this key")
    ssl_context = None
    if args.ca_file:
        with open(args.ca_file) as f:
            ssl_context = dataplane_ssl_context(f.read())
    dp = DataPlaneClient(
        cache.endpoint, kcaas.TokenSource(client, cache.id, "read"), cache.id, cache.spec, ssl_context=ssl_context
    )
    bridge = EventsBridge(dp, args.endpoint, args.replay_endpoint)
    stop = threading.Event()
    print(f"events of cache {cache.name} ({cache.id}) on {args.endpoint}, replay {args.replay_endpoint}", flush=True)
    try:
        bridge.run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        bridge.close()
        dp.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
