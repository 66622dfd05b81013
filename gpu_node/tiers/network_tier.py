"""The network tier of one cache: sealed block objects in the fleet's shared store (gpu_node/tiers/object_store.py).

A `tiers.Tier` below DRAM and SSD (docs/ARCHITECTURE.md, "The network tier"):

- names: `kc/<tag>/<id>`, tag = HMAC-SHA256(name key, "cache") and id = HMAC-SHA256(name key, block hash), the name
  key derived from the cache's data key: the same on every node that hosts the cache, different for every cache, and
  never the plain token hash (the block hash is the cache's chained *keyed* hash, and the name is a MAC of it);
- objects: gpu_node/tiers/ssd_records.py records (payload and lineage AES-GCM-sealed under the data key) whose
  associated
  data binds the object's name; a read that does not decrypt, names another block or fails its checksum is a miss,
  counted in num_checksum_failures, and the object is removed;
- the index (hash -> record bytes, LRU order) holds what this tier stored or found by `probe`; `contains` reads only
  the index (no I/O: callable under the cache lock); `probe` asks the store (without the cache lock);
- writes are queued to the tier's writer thread (demotions happen under the cache lock) and readable at once from
  the pending set; `flush` waits for them (write-through puts); removals (discard, clear) are queued behind the
  writes before them, so a removal always follows the write it undoes (a batch of puts is one store call, its
  chunks pipelined inside it where the client pipelines: the next chunk sealed while the last is in flight; the
  call answers after its last transfer, so nothing queued behind it starts before every object was sent);
- reads of a run are one store call too, pipelined the other way (a chunk opened while the next is in flight);
- the store's faults are the guard's (misses, never errors); a write the store refused is dropped and counted.

Invariants (under `_lock`): bytes_resident == sum of the index's record bytes <= capacity_bytes; a hash is never both
pending and indexed; after `wipe` nothing is stored any more and the cache's objects were removed from the store.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.engine.block_hash import BlockHash, BlockLineage, PushedOut
from gpu_node.engine.checksum import verify_block
from gpu_node.engine.zeroing import zero
from gpu_node.tiers import ssd_records
from gpu_node.tiers.guarded_store import GuardedStore

NAME_KEY_LABEL = b"kcaas/network/names/v1"
AAD_PREFIX = b"kcaas/net/v1/"
MAX_PENDING_BYTES = 256 << 20  # writes queued beyond this are dropped (the store is behind): bounded memory
FLUSH_TIMEOUT_S = 10.0
DEFAULT_SLOT_BYTES = 4 << 20
WRITE_BATCH_BLOCKS = 16  # queued puts sent in one store call (in pipelined chunks: the client's chunk_blocks)
CORRUPT = object()  # what opening a record that is not this block's answers


def _let_go(opened) -> None:
    """A record opened after its reader gave up (past the store's deadline): its plaintext is zeroed."""
    if opened is not CORRUPT and opened is not None:
        zero(opened[0])


def object_names(data_key: bytes) -> Callable[[BlockHash], str]:
    """The name of each block's object for the cache whose data key this is (and its prefix, as `.prefix`)."""
    name_key = hmac.new(data_key, NAME_KEY_LABEL, hashlib.sha256).digest()
    tag = hmac.new(name_key, b"cache", hashlib.sha256).hexdigest()[:32]

    def name(block_hash: BlockHash) -> str:
        return f"kc/{tag}/{hmac.new(name_key, bytes(block_hash), hashlib.sha256).hexdigest()[:48]}"

    name.prefix = f"kc/{tag}/"  # type: ignore[attr-defined]
    return name


class NetworkTier:
    """Blocks of one cache in the fleet's store (see the module docstring)."""

    def __init__(self, store: GuardedStore, data_key: bytes, capacity_bytes: int, *, write_through: bool = False):
        self._store = store
        self._aead = AESGCM(data_key)
        self._name = object_names(data_key)
        self.prefix: str = self._name.prefix  # type: ignore[attr-defined]
        self.capacity_bytes = int(capacity_bytes)
        self.write_through = write_through
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> record bytes, least recently used first
        self._pending: dict[BlockHash, tuple[bytearray, int, tuple | None]] = {}
        self._pending_bytes = 0
        self._queue: list[tuple[str, Any]] = []  # ("put", hash) | ("remove", [names]) | ("remove_prefix", prefix)
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._busy = False
        self._wiped = False
        self.bytes_resident = 0
        self.num_checksum_failures = 0
        self.num_dropped_writes = 0
        self.num_probes = 0
        self.num_write_through_timeouts = 0  # write-through puts acknowledged before the store had their blocks
        self._record_bytes = 0  # the size of this cache's records, once one was written or read
        self._writer = threading.Thread(target=self._write_loop, name="kcaas-network-tier", daemon=True)
        self._writer.start()

    # ---- queries (no I/O) --------------------------------------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index or block_hash in self._pending

    __contains__ = contains

    def __len__(self) -> int:
        return len(self._index) + len(self._pending)

    def is_stored(self, block_hash: BlockHash) -> bool:
        """In the store (as far as this tier knows), not merely queued for it."""
        return block_hash in self._index

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index) + list(self._pending)

    @property
    def healthy(self) -> bool:
        return self._store.healthy

    # ---- the store (without the cache lock) --------------------------------------------------------------------------
    def probe(self, hashes: Sequence[BlockHash]) -> int:
        """Ask the store which of `hashes` it holds that this tier does not know of yet; they join the index.
        Returns how many were found. One batched question; a store fault finds nothing."""
        unknown = [BlockHash(bytes(h)) for h in hashes if not self.contains(h)]
        if not unknown or self._wiped:
            return 0
        self.num_probes += 1
        found = [h for h, held in zip(unknown, self._store.exists([self._name(h) for h in unknown])) if held]
        with self._lock:
            for block_hash in found:
                if block_hash not in self._index and block_hash not in self._pending and not self._wiped:
                    self._index_locked(block_hash, self._estimated_bytes())
            self._evict_locked()
        return len(found)

    def read(self, block_hash: BlockHash) -> bytearray | None:
        fetched = self.fetch(block_hash)
        return fetched[0] if fetched is not None else None

    def fetch(self, block_hash: BlockHash) -> tuple[bytearray, tuple | None] | None:
        """(verified payload, lineage) of a block, or None (absent, evicted by the store, corrupt or foreign: the
        last two counted and removed). The tier keeps the block (inclusive)."""
        return self.fetch_many([block_hash])[0]

    def fetch_many(self, hashes: Sequence[BlockHash]) -> list[tuple[bytearray, tuple | None] | None]:
        """`fetch` of each hash, in order: one store call (pipelined batched transfers into the store client's reused
        buffers, each record opened straight from them) for those not still queued here."""
        hashes = [BlockHash(bytes(h)) for h in hashes]
        results: list[tuple[bytearray, tuple | None] | None] = [None] * len(hashes)
        wanted: dict[str, int] = {}
        with self._lock:
            for i, block_hash in enumerate(hashes):
                pending = self._pending.get(block_hash)
                if pending is not None:  # verified: a payload being sealed is zeroed once sealed, before it leaves
                    copy = bytearray(pending[0])
                    results[i] = (copy, pending[2]) if verify_block(pending[1], copy) else None
                elif block_hash in self._index:
                    self._index.move_to_end(block_hash)
                    wanted[self._name(block_hash)] = i
        if not wanted:
            return results
        names = list(wanted)

        def open_record(name: str, view: memoryview):
            return self._open(hashes[wanted[name]], name, view)

        if len(names) == 1:  # one block: the plain transfer (a batch of one costs more)
            opened = [self._store.read(names[0], open_record, _let_go)]
        else:
            opened = self._store.read_many(names, open_record, self._slot_bytes(), _let_go)
        for name, answer in zip(names, opened):
            results[wanted[name]] = self._settle(hashes[wanted[name]], name, answer)
        return results

    def _open(self, block_hash: BlockHash, name: str, view: memoryview):
        """On the store's thread: (payload, lineage, record bytes) of a record that decrypts under this cache's key
        with its name bound in, names `block_hash` and matches its checksum; else CORRUPT."""
        decoded = ssd_records.decode(self._aead, view, 0, aad_prefix=AAD_PREFIX + name.encode())
        if decoded is None or decoded[0] != block_hash or decoded[2] != len(view):
            if decoded is not None:
                zero(decoded[1])
            return CORRUPT
        return decoded[1], decoded[3], len(view)

    def _settle(self, block_hash: BlockHash, name: str, answer) -> tuple[bytearray, tuple | None] | None:
        if answer is None:  # evicted by the store, removed by another node, or the store is down: a miss
            if self._store.healthy:  # gone from the store (a fault keeps the entry: the store may come back)
                self._forget(block_hash)
            return None
        if answer is CORRUPT:
            self._corrupt(block_hash, name)
            return None
        payload, lineage, nbytes = answer
        with self._lock:
            self._record_bytes = nbytes
            if block_hash in self._index:
                self._resize_locked(block_hash, nbytes)
        return payload, lineage

    def _slot_bytes(self) -> int:
        """The transfer slot of one object: the size of this cache's records once one was seen (they are all one
        size), else generous."""
        return self._record_bytes or DEFAULT_SLOT_BYTES

    def store(
        self, block_hash: BlockHash, payload: bytearray, checksum: int, lineage: BlockLineage | None = None
    ) -> list[PushedOut]:
        """Queue a block for the store (the tier owns `payload`: zeroed once written or dropped); readable at once.
        Returns [] (the last tier: nothing is pushed further)."""
        block_hash = BlockHash(bytes(block_hash))
        with self._lock:
            if self._wiped or block_hash in self._index or block_hash in self._pending:
                zero(payload)
                return []
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES or len(payload) > self.capacity_bytes:
                self.num_dropped_writes += 1
                zero(payload)
                return []
            self._pending[block_hash] = (payload, checksum, lineage)
            self._pending_bytes += len(payload)
            self._queue.append(("put", block_hash))
            self._work.notify()
        return []

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued write and removal reached the store (or was dropped); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    # ---- forgetting ----------------------------------------------------------------------------------------------
    def discard(self, hashes) -> int:
        """Forget these blocks (no I/O: the objects' removal is queued, for every hash given, known here or not:
        another node may have stored it). Returns how many this tier knew."""
        names, removed = [], 0
        with self._lock:
            for block_hash in hashes:
                block_hash = BlockHash(bytes(block_hash))
                removed += self._drop_locked(block_hash)
                names.append(self._name(block_hash))
            if names and not self._wiped:
                self._queue.append(("remove", names))
                self._work.notify()
        return removed

    def clear(self) -> int:
        """Forget every block of the cache, in the store too (every object under the cache's prefix)."""
        with self._lock:
            removed = len(self._index) + len(self._pending)
            for block_hash in list(self._index) + list(self._pending):
                self._drop_locked(block_hash)
            if not self._wiped:
                self._queue.append(("remove_prefix", self.prefix))
                self._work.notify()
        return removed

    def sync(self) -> None:
        """Make forgetting reach the store (waits for the queue, bounded)."""
        self.flush()

    def wipe(self) -> int:
        """Erasure: remove every object of the cache from the store, forget everything, store nothing more; returns
        the bytes that were resident."""
        with self._lock:
            resident = self.bytes_resident + self._pending_bytes
            self._wiped = True
            for block_hash in list(self._index) + list(self._pending):
                self._drop_locked(block_hash)
            self._queue.clear()
            self._work.notify()
        self._store.remove_prefix(self.prefix)
        return resident

    def close(self) -> None:
        """Stop the writer once its queue is done (objects stay in the store: they are the cache's, not the node's)."""
        self.flush()
        with self._lock:
            self._wiped = True
            self._queue.clear()
            self._work.notify()

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_resident == sum(self._index.values()) <= self.capacity_bytes
            assert not set(self._index) & set(self._pending)
            assert self._pending_bytes == sum(len(p[0]) for p in self._pending.values())

    # ---- the writer thread -------------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._lock:
                self._busy = False
                if not self._queue:
                    self._idle.notify_all()
                self._work.wait_for(lambda: self._queue or (self._wiped and not self._busy))
                if not self._queue:
                    self._idle.notify_all()
                    return
                op, arg = self._queue.pop(0)
                self._busy = True
                puts = self._take_puts_locked(arg) if op == "put" else []
            if puts:
                self._put_many(puts)
            elif op == "remove":
                self._store.remove(arg)
            elif op == "remove_prefix":
                self._store.remove_prefix(arg)

    def _take_puts_locked(self, first: BlockHash) -> list[tuple[BlockHash, tuple]]:
        """The put `first` and the puts queued right behind it (up to a batch), with their pending entries: one
        batched transfer for them. Forgotten ones are skipped."""
        hashes = [first]
        while self._queue and self._queue[0][0] == "put" and len(hashes) < WRITE_BATCH_BLOCKS:
            hashes.append(self._queue.pop(0)[1])
        return [(h, self._pending[h]) for h in hashes if h in self._pending]

    def _put_many(self, puts: list[tuple[BlockHash, tuple]]) -> None:
        names = [self._name(block_hash) for block_hash, _ in puts]
        sizes = [ssd_records.record_bytes(len(p[0]), len(p[2][1]) if p[2] is not None else 0) for _, p in puts]

        def seal(i: int, out: memoryview) -> None:  # on the store's thread, into its reused buffer: no allocation
            block_hash, (payload, checksum, lineage) = puts[i]
            ssd_records.encode_into(
                out, self._aead, block_hash, payload, checksum, lineage, aad_prefix=AAD_PREFIX + names[i].encode()
            )

        def let_go() -> None:  # once sealing is over (even past the store's deadline): the plaintext is zeroed
            for _, (payload, _, _) in puts:
                zero(payload)

        stored = self._store.write_many(names, sizes, seal, let_go)
        with self._lock:
            for (block_hash, pending), nbytes, ok in zip(puts, sizes, stored):
                if self._pending.get(block_hash) is not pending:
                    continue  # forgotten while it was written: the removal queued behind it undoes it
                self._take_pending_locked(block_hash)
                if ok:
                    self._record_bytes = nbytes
                    self._index_locked(block_hash, nbytes)
                else:
                    self.num_dropped_writes += 1
            self._evict_locked()

    # ---- bookkeeping (under _lock) -----------------------------------------------------------------------------------
    def _estimated_bytes(self) -> int:
        """A probed object's size before it is read: the size of this cache's records once one was seen, else 0
        (fixed on read). Blocks of one cache have one payload size and lineage length, so this is exact then."""
        return self._record_bytes

    def _index_locked(self, block_hash: BlockHash, nbytes: int) -> None:
        self._index[block_hash] = nbytes
        self.bytes_resident += nbytes

    def _resize_locked(self, block_hash: BlockHash, nbytes: int) -> None:
        self.bytes_resident += nbytes - self._index[block_hash]
        self._index[block_hash] = nbytes

    def _take_pending_locked(self, block_hash: BlockHash) -> tuple | None:
        pending = self._pending.pop(block_hash, None)
        if pending is not None:
            self._pending_bytes -= len(pending[0])
        return pending

    def _drop_locked(self, block_hash: BlockHash) -> int:
        nbytes = self._index.pop(block_hash, None)
        if nbytes is not None:
            self.bytes_resident -= nbytes
        pending = self._take_pending_locked(block_hash)
        if pending is not None:
            zero(pending[0])
        return int(nbytes is not None or pending is not None)

    def _evict_locked(self) -> None:
        """Keep within capacity: the least recently used objects are removed from the store (queued)."""
        names = []
        while self.bytes_resident > self.capacity_bytes and self._index:
            block_hash, nbytes = self._index.popitem(last=False)
            self.bytes_resident -= nbytes
            names.append(self._name(block_hash))
        if names:
            self._queue.append(("remove", names))
            self._work.notify()

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._drop_locked(block_hash)

    def _corrupt(self, block_hash: BlockHash, name: str) -> None:
        with self._lock:
            self.num_checksum_failures += 1
            self._drop_locked(block_hash)
            self._queue.append(("remove", [name]))
            self._work.notify()
