"""Node-to-node block transfer for cache migration: a listener on the target, a sender on the source (no Django).

Transport: mutual TLS 1.3 only. The listener REQUIRES a client certificate chained to the platform CA and accepts a
connection for a migration only when the peer's node id (its SPIFFE URI SAN `spiffe://kcaas/node/<uuid>`) is the
source the control plane named in migrate_in; the sender checks the target's node id the same way. Contexts come
from gpu_node.agent.identity.NodeIdentity (server_context()/client_context()) or, in tests, from dev_pki node certs.

Protocol (after the handshake; every message is 1 type byte + 4-byte little-endian length + body):
    sender -> target  H  JSON {"migration_id", "cache_id", "epoch"}        target -> sender  K  the keys it holds
    sender -> target  B  BLOCK_HEAD (parent, key, full, n tokens, checksum) + tokens int32 + stored bytes
    sender -> target  N  NET_HEAD (parent, key, n tokens) + tokens int32, repeated: full blocks the fleet's network
                         store holds (the source's network tier stored them); the target adopts those the store
                         confirms                                           target -> sender  K  the keys it holds
    sender -> target  Y  sync                                               target -> sender  K  the keys it holds
    target -> sender  E  JSON {"error"} and close (unknown migration, wrong peer, bad block)
A source with a network tier announces (N) the blocks the store holds right after the first K, so only the blocks
the store lacks cross the wire; the target reads the others from the store when they are asked for.
Resumable: the target inserts every verified block as it arrives, and every K lists what it holds, so a sender that
(re)connects after either side was cut skips verified blocks. A block whose checksum does not match is refused
(counted in `stats["checksum_failures"]`), is absent from the next K, and is sent again.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpu_node.agent import identity
from gpu_node.engine.block_hash import HASH_NUM_BYTES, BlockHash
from gpu_node.engine.zeroing import zero
from gpu_node.errors import NodeError
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.journal import IncomingJournal

log = logging.getLogger("kcaas.node.migration")
MSG_HEAD = struct.Struct("<cI")
BLOCK_HEAD = struct.Struct("<16s16s?IQ")  # parent, key, full, num tokens, checksum
NET_HEAD = struct.Struct("<16s16sI")  # parent, key, num tokens
MAX_CONTROL_BYTES = 64 << 20


class MigrationError(NodeError):
    """A migration transfer that cannot go on (a malformed message, a refused peer); the sender resends later."""


# ---- identity ---------------------------------------------------------------------------------------------------
def peer_node_id(sock: ssl.SSLSocket) -> str | None:
    """The node id (canonical UUID) in the verified peer certificate's one SPIFFE URI SAN, or None
    (gpu_node.agent.identity.peer_node_id, which raises instead)."""
    try:
        return identity.peer_node_id(sock)
    except identity.PeerIdentityError:
        return None


def is_peer(sock: ssl.SSLSocket, node_id: str) -> bool:
    """Is the peer of this mutual-TLS connection the node `node_id` (the one the control plane named)?"""
    try:
        return peer_node_id(sock) == str(uuid.UUID(str(node_id)))
    except ValueError:
        return False


def mtls_server_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """TLS 1.3 only, a client certificate from the CA required (NodeIdentity.server_context() once it lands)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert_file, key_file)
    ctx.load_verify_locations(ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def mtls_client_context(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """TLS 1.3 only, presenting this node's certificate; the peer is checked by SPIFFE id, not host name."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert_file, key_file)
    ctx.load_verify_locations(ca_file)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


# ---- framing ----------------------------------------------------------------------------------------------------
def _recv_exact(sock, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise MigrationError("the peer closed the connection")
        got += n


def _recv_msg(sock) -> tuple[bytes, bytearray, int]:
    head = bytearray(MSG_HEAD.size)
    _recv_exact(sock, memoryview(head))
    kind, length = MSG_HEAD.unpack(head)
    if kind != b"B" and length > MAX_CONTROL_BYTES:
        raise MigrationError("oversized control message")
    body = bytearray(length if kind != b"B" else BLOCK_HEAD.size)
    _recv_exact(sock, memoryview(body))
    return kind, body, length


def _send_msg(sock, kind: bytes, body: bytes = b"") -> None:
    sock.sendall(MSG_HEAD.pack(kind, len(body)) + body)


def _keys_from(body: bytes | bytearray) -> set[BlockHash]:
    return {BlockHash(bytes(body[i : i + HASH_NUM_BYTES])) for i in range(0, len(body), HASH_NUM_BYTES)}


def _network_blocks_body(metas: list[bt.BlockMeta]) -> bytes:
    parts = []
    for meta in metas:
        tokens = np.ascontiguousarray(meta.tokens, dtype="<i4")
        parts.append(NET_HEAD.pack(meta.parent, meta.key, len(tokens)) + tokens.tobytes())
    return b"".join(parts)


def _network_blocks_from(body: bytes | bytearray, block_size: int) -> list[bt.BlockMeta]:
    """The N message's entries; MigrationError for a malformed one (a token count over the block size, a short body)."""
    metas, at = [], 0
    while at < len(body):
        if len(body) - at < NET_HEAD.size:
            raise MigrationError("a truncated network block entry")
        parent, key, num_tokens = NET_HEAD.unpack_from(body, at)
        at += NET_HEAD.size
        if num_tokens != block_size or len(body) - at < 4 * num_tokens:
            raise MigrationError("a network block entry that is not one full block")
        tokens = np.frombuffer(body, dtype="<i4", count=num_tokens, offset=at).copy()
        at += 4 * num_tokens
        metas.append(bt.BlockMeta(-1, parent, key, True, tokens, lower=True))
    return metas


# ---- the target's listener ----------------------------------------------------------------------------------------
@dataclass
class Incoming:
    """A migration this node expects (migrate_in): which cache, from which node, at which epoch."""

    migration_id: str
    cache_id: str
    source_node_id: str
    epoch: int


@dataclass
class ListenerStats:
    blocks_stored: int = 0
    bytes_stored: int = 0
    checksum_failures: int = 0
    refused: dict = field(default_factory=dict)
    blocks_restored: int = 0  # published again from the SSD journal after a restart (never received twice)


class MigrationListener:
    """Accepts senders named by `expect()`; inserts verified blocks into `registry`'s engine for the cache.

    When the incoming cache has an SSD tier, every verified full block is also written through to it and journaled
    (gpu_node/migration/journal.py), durably before a K answer lists it (and at least every `durable_every` blocks):
    a SIGKILLed target provisioned again with the same id/epoch/keys republishes those blocks at `expect()`, so the
    resuming sender skips them. Without an SSD tier a killed target restarts empty (device memory does not survive).
    """

    def __init__(
        self,
        registry,
        tls_context: ssl.SSLContext,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics=None,
        durable_every: int = 64,
    ):
        assert tls_context.verify_mode == ssl.CERT_REQUIRED, "the migration listener requires client certificates"
        self.registry, self.tls_context, self.metrics = registry, tls_context, metrics
        self.durable_every = durable_every
        self._expected: dict[str, Incoming] = {}
        self._journals: dict[str, IncomingJournal] = {}
        self._lock = threading.Lock()
        self.stats = ListenerStats()
        self._sock = socket.create_server((host, port), backlog=32)
        self._sock.settimeout(0.2)
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="migration-accept")

    @property
    def endpoint(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def start(self) -> MigrationListener:
        self._thread.start()
        return self

    def expect(self, incoming: Incoming) -> None:
        """Accept this migration's sender; blocks a previous run of this node journaled are published again now."""
        with self._lock:
            self._expected[incoming.migration_id] = incoming
        hosted = self.registry.get(incoming.cache_id)
        if hosted is not None and hosted.epoch == incoming.epoch:
            self._journal_for(incoming, hosted)

    def _journal_for(self, incoming: Incoming, hosted) -> IncomingJournal | None:
        """The journal of `incoming` on `hosted`'s SSD store (None without one); opening it replays it once."""
        ssd = hosted.engine.tiers.ssd if hosted.engine.tiers is not None else None
        if ssd is None:
            return None
        with self._lock:
            journal = self._journals.get(incoming.migration_id)
            if journal is not None and journal.ssd is ssd:
                return journal
            if journal is not None:
                journal.close()
            journal = self._journals[incoming.migration_id] = IncomingJournal(ssd, incoming.migration_id)
            restored = journal.replay(hosted.engine)
            self.stats.blocks_restored += restored
        if self.metrics is not None:
            self.metrics.migration_blocks_restored.inc(restored)
        log.info("migration %s: %d blocks restored from the SSD journal", incoming.migration_id, restored)
        return journal

    def stop(self) -> None:
        """Close the listener and cut every transfer in flight (what was verified stays stored)."""
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True, name="migration-conn").start()

    def _serve(self, raw: socket.socket) -> None:
        with self._lock:
            self._conns.add(raw)
        try:
            raw.settimeout(60)
            with self.tls_context.wrap_socket(raw, server_side=True) as sock:
                self._session(sock)
        except (OSError, ssl.SSLError, MigrationError) as exc:
            log.info("migration connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(raw)
            raw.close()

    def _session(self, sock: ssl.SSLSocket) -> None:
        kind, body, _ = _recv_msg(sock)
        hello = json.loads(body) if kind == b"H" else {}
        with self._lock:
            incoming = self._expected.get(str(hello.get("migration_id")))
        hosted = self.registry.get(incoming.cache_id) if incoming is not None else None
        if incoming is None or hosted is None or hello.get("cache_id") != incoming.cache_id:
            return _send_msg(sock, b"E", b'{"error": "unknown_migration"}')
        if hosted.epoch != incoming.epoch:
            return _send_msg(sock, b"E", b'{"error": "unknown_migration"}')
        if not is_peer(sock, incoming.source_node_id):
            return _send_msg(sock, b"E", b'{"error": "wrong_peer"}')
        engine = hosted.engine
        journal = self._journal_for(incoming, hosted)
        _send_msg(sock, b"K", b"".join(bt.held_keys(engine)))
        staging = bytearray(bt.block_nbytes(engine))
        try:
            while True:
                kind, body, length = _recv_msg(sock)
                if kind == b"N":
                    bt.adopt_network_blocks(engine, _network_blocks_from(body, engine.block_size))
                    _send_msg(sock, b"K", b"".join(bt.held_keys(engine)))
                elif kind == b"Y":
                    if journal is not None:
                        journal.sync()  # what K lists survives a SIGKILL of this process
                    _send_msg(sock, b"K", b"".join(bt.held_keys(engine)))
                elif kind == b"B" and length == len(staging):
                    self._block(sock, engine, body, staging, journal, cache_id=incoming.cache_id)
                else:
                    return
        finally:
            zero(staging)  # it held KV: zeroed before it is freed

    def _block(self, sock, engine, head: bytearray, staging: bytearray, journal=None, cache_id: str = "") -> None:
        parent, key, full, num_tokens, checksum = BLOCK_HEAD.unpack(head)
        if num_tokens > engine.block_size:
            raise MigrationError("a block with too many tokens")
        tokens = np.empty(num_tokens, dtype="<i4")
        _recv_exact(sock, tokens.view(np.uint8).data)
        verdict = bt.receive_block(
            engine, parent, key, full, tokens, checksum, lambda view: _recv_exact(sock, view), staging
        )
        if verdict == "stored" and full and journal is not None:
            journal.write_through(engine, parent, key, tokens)
            if journal.unsynced >= self.durable_every:
                journal.sync()
        with self._lock:
            if verdict == "stored":
                self.stats.blocks_stored += 1
                self.stats.bytes_stored += len(staging)
            elif verdict == "checksum":
                self.stats.checksum_failures += 1
            self.stats.refused[verdict] = self.stats.refused.get(verdict, 0) + (verdict not in ("stored", "have"))
        if self.metrics is not None:
            self.metrics.migration_blocks_received.labels(verdict=verdict).inc()
            if verdict == "stored":
                self.metrics.node.count_migrated(cache_id, len(staging))
        if verdict not in ("stored", "have") and self.metrics is not None:
            self.metrics.migration_blocks_refused.labels(reason=verdict).inc()


# ---- the source's sender ------------------------------------------------------------------------------------------
def _pace_sleep(sent_bytes: int, since: float, rate: float) -> float:
    """Seconds to wait so that `sent_bytes` since `since` stay within `rate` bytes per second."""
    return max(0.0, sent_bytes / rate - (time.monotonic() - since))


@dataclass
class SenderStats:
    blocks_sent: int = 0
    bytes_sent: int = 0
    rounds: int = 0
    connects: int = 0
    keys_sent: list = field(default_factory=list)  # every block key sent, in order (tests count resends)
    blocks_from_network: int = 0  # blocks the target adopted from the network store instead of the wire


class MigrationSender:
    """Streams one cache's blocks to the target until the target holds every block of the snapshot.

    `run(fence)`: bulk rounds while writes continue, then `fence()` (the data plane stops acknowledging writes),
    then rounds until a sync shows the target holds everything. `corrupt(key) -> bool` (a test hook) flips one byte
    of that block on the wire, keeping its true checksum. `cut_after_blocks` (a test hook) closes the connection
    abruptly after that many blocks, as a killed process would. `max_bytes_per_second` caps this sender's rate
    (None: unpaced), so a migration leaves the node's network to the data plane.
    """

    def __init__(
        self,
        engine,
        *,
        migration_id: str,
        cache_id: str,
        epoch: int,
        target_endpoint: str,
        target_node_id: str,
        tls_context: ssl.SSLContext,
        progress: Callable[[dict], None] | None = None,
        corrupt: Callable[[bytes], bool] | None = None,
        cut_after_blocks: int | None = None,
        connect_timeout: float = 30.0,
        max_rounds: int = 8,
        max_bytes_per_second: float | None = None,
    ):
        self.engine, self.migration_id, self.cache_id, self.epoch = engine, migration_id, cache_id, int(epoch)
        self.target_endpoint, self.target_node_id, self.tls_context = target_endpoint, target_node_id, tls_context
        self.progress, self.corrupt, self.cut_after_blocks = progress, corrupt, cut_after_blocks
        self.connect_timeout, self.max_rounds = connect_timeout, max_rounds
        self.max_bytes_per_second = max_bytes_per_second
        self._paced_since: float | None = None
        self.stats = SenderStats()

    def run(self, fence: Callable[[], None] | None = None) -> SenderStats:
        with self._connect() as sock:
            have = self._hello(sock)
            have = self._rounds(sock, have, self.max_rounds, until_empty=False)
            if fence is not None:
                fence()
            self._rounds(sock, have, self.max_rounds, until_empty=True)
        return self.stats

    def _connect(self) -> ssl.SSLSocket:
        """Connect (retrying while the target is not ready: it may still be provisioning, or restarting)."""
        host, _, port = self.target_endpoint.rpartition(":")
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                raw = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
                sock = self.tls_context.wrap_socket(raw)
                if not is_peer(sock, self.target_node_id):
                    sock.close()
                    raise MigrationError("the target's certificate names another node")
                self.stats.connects += 1
                return sock
            except (OSError, ssl.SSLError):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _hello(self, sock) -> set[BlockHash]:
        body = json.dumps({"migration_id": self.migration_id, "cache_id": self.cache_id, "epoch": self.epoch})
        _send_msg(sock, b"H", body.encode())
        have = self._keys(sock)
        announced = bt.network_held(self.engine, [m for m in bt.snapshot(self.engine) if m.key not in have])
        if not announced:
            return have
        _send_msg(sock, b"N", _network_blocks_body(announced))
        have = self._keys(sock)
        self.stats.blocks_from_network = sum(meta.key in have for meta in announced)
        return have

    def _keys(self, sock) -> set[BlockHash]:
        kind, body, _ = _recv_msg(sock)
        if kind == b"E":
            raise MigrationError(f"the target refused: {json.loads(body).get('error')}")
        if kind != b"K":
            raise MigrationError("unexpected answer from the target")
        return _keys_from(body)

    def _rounds(self, sock, have: set[BlockHash], limit: int, *, until_empty: bool) -> set[BlockHash]:
        """Send what the target lacks, sync, repeat: until nothing is missing (or, in bulk, nothing was sent)."""
        for _ in range(limit):
            todo = [m for m in bt.snapshot(self.engine) if m.key not in have]
            if not todo:
                return have
            sent = sum(self._send_block(sock, meta) for meta in todo)
            _send_msg(sock, b"Y")
            have = self._keys(sock)
            self.stats.rounds += 1
            if self.progress is not None:
                self.progress({"blocks": len(have), "bytes_sent": self.stats.bytes_sent})
            if not sent and not until_empty:
                return have
        if until_empty and [m for m in bt.snapshot(self.engine) if m.key not in have]:
            raise MigrationError(f"the target still lacks blocks after {limit} rounds")
        return have

    def _send_block(self, sock, meta: bt.BlockMeta) -> int:
        held = bt.read_block(self.engine, meta)
        if held is None:
            return 0  # changed or evicted since the snapshot: the next round sees it as it is now
        try:
            parts = held.parts
            if self.corrupt is not None and self.corrupt(meta.key):
                flipped = bytearray(b"".join(bytes(p) for p in parts))
                flipped[len(flipped) // 2] ^= 0x01
                parts = [memoryview(flipped)]
            nbytes = sum(len(p) for p in parts)
            tokens = np.ascontiguousarray(meta.tokens, dtype="<i4").tobytes()
            head = MSG_HEAD.pack(b"B", nbytes) + BLOCK_HEAD.pack(
                meta.parent, meta.key, meta.full, len(meta.tokens), held.checksum
            )
            sock.sendall(head + tokens)
            for part in parts:
                sock.sendall(part)
        finally:
            held.release()
        self.stats.blocks_sent += 1
        self.stats.bytes_sent += nbytes
        self.stats.keys_sent.append(meta.key)
        self._pace()
        if self.cut_after_blocks is not None and self.stats.blocks_sent >= self.cut_after_blocks:
            sock.shutdown(socket.SHUT_RDWR)
            raise MigrationError("cut by the test hook")
        return 1

    def _pace(self) -> None:
        if not self.max_bytes_per_second:
            return
        if self._paced_since is None:
            self._paced_since = time.monotonic()
        time.sleep(_pace_sleep(self.stats.bytes_sent, self._paced_since, self.max_bytes_per_second))
