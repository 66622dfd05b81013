"""The SSD tier of one cache: encrypted blocks in append-only segment files, an index that survives crashes.

Directory `<root>/<cache id>/` (root: KCAAS_NODE_SSD_DIR):

    seg-000001.log ...   records, appended by this store's writer thread only, fsync'd per batch
    index.json           the live entries as of the last commit: written to index.json.tmp, fsync, rename, fsync dir

Record = HEADER (magic, payload ciphertext length, block hash, nonce, xxh3-64 of the plaintext payload, parent hash,
number of tokens, tokens nonce) + AES-GCM(data key, nonce, payload, aad = AAD_PREFIX + "kv" + block hash + parent
hash + number of tokens) + AES-GCM(data key, tokens nonce, int32 tokens, aad = the same with "tk"), each 16 bytes
longer than its plaintext (no tokens part without lineage: 0 tokens, a zero parent). Two messages, so the payload is
encrypted straight from its buffer (no copy to join it with the tokens). The associated data binds a record to its
name and lineage, so records cannot be swapped; the lineage (parent, tokens) is what lets a warm-restarted cache
forget a prefix and everything chained under it, and migrate rescanned blocks. The data key (32 bytes) comes
from the control plane in provision_cache and lives in this process's memory only: without it the files are noise.

Crash safety: a record becomes visible to readers only after its batch is fsync'd (until then it is served from
`_pending`). A crash may leave a torn record at a segment's end and records the index does not name yet; `rescan`
(run when a store opens an existing directory: warm restart) reads every block named by the index and every record
after each segment's committed end, keeps only those that decrypt and match their checksum, and never appends to
an old segment again (new writes go to a fresh one).

Forgetting (`discard`, `clear`): entries leave the index and the pending set at once (a block being appended is not
indexed when its write completes); `sync` then waits for the writer and commits the index, so a restart does not
bring them back (records before a segment's committed end are only ever admitted through the index). Segments
with no live record are deleted. `wipe` stops the writer and deletes the directory.

Payload buffers handed to `store` are owned by the store (unless owned=False): zeroed once written or forgotten, so
no plaintext KV is left in freed heap memory.

Invariants (under `_lock`): bytes_resident == sum of entry.length over `_index` <= capacity_bytes; every entry
names a record fully written and fsync'd; no lock is held during file I/O, and nothing here is shared by two caches.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.checksum import verify_block
from gpu_node.zeroing import zero

HEADER = struct.Struct("<4sI16s12sQ16sI12s")  # magic, payload ct length, hash, nonce, xxh3, parent, n tokens, nonce
MAGIC = b"KCB2"
NO_PARENT = bytes(16)
AAD_PREFIX = b"kcaas/ssd/v1/"
TAG_BYTES = 16
DATA_KEY_BYTES = 32
SEGMENT_BYTES = 64 << 20
INDEX_NAME = "index.json"
WRITE_BATCH = 64  # records per fsync at most
MAX_PENDING_BLOCKS = 256  # blocks queued for the writer at most: beyond, demotions to SSD are dropped (counted)


@dataclass(frozen=True, slots=True)
class Entry:
    segment: int
    offset: int  # of the record's header
    length: int  # of the plaintext payload
    record_length: int  # of the whole record (header, ciphertext of payload and tokens, tag)


def segment_name(segment: int) -> str:
    return f"seg-{segment:06d}.log"


class SsdStore:
    """The SSD tier of one cache (implements gpu_node.tiers.Tier)."""

    def __init__(self, directory: str, data_key: bytes, capacity_bytes: int, *, segment_bytes: int = SEGMENT_BYTES):
        if not isinstance(data_key, bytes) or len(data_key) != DATA_KEY_BYTES:
            raise ValueError(f"the SSD data key must be {DATA_KEY_BYTES} bytes")
        self.directory = directory
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = segment_bytes
        self._aead = AESGCM(data_key)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, Entry] = OrderedDict()  # LRU first
        self._pending: dict[bytes, _Pending] = {}  # queued or being written: served from here
        self._in_write: set[bytes] = set()  # pending blocks the writer is appending now (it zeroes them after)
        self._lineage: dict[bytes, tuple[bytes, np.ndarray]] = {}  # found by rescan: hash -> (parent, tokens)
        self._segment_live: dict[int, int] = {}  # segment -> live entries
        self._committed_end: dict[int, int] = {}  # segment -> bytes fsync'd
        self.bytes_resident = 0
        self.num_checksum_failures = 0
        self.num_rescanned_blocks = 0
        self.num_dropped_writes = 0
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.rescan()
        self._segment = max(self._committed_end, default=0) + 1  # never append after a possibly torn tail
        self._segment_fd: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name=f"ssd-writer-{os.path.basename(directory)}",
                                        daemon=True)  # fmt: skip
        self._writer.start()

    # ---- reads ----------------------------------------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._index or block_hash in self._pending

    def __len__(self) -> int:
        return len(self._index) + len(self._pending)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._index) + [h for h in self._pending if h not in self._index]

    def lineages(self) -> dict[bytes, tuple[bytes, np.ndarray]]:
        """(parent, tokens) of the blocks a rescan found with their lineage (warm restart)."""
        with self._lock:
            return {h: lineage for h, lineage in self._lineage.items() if h in self._index}

    def read(self, block_hash: bytes) -> bytearray | None:
        """The verified payload of a block, or None (absent, or corrupt: then dropped and counted)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            copy = bytearray(pending.payload) if pending is not None else None
            entry = self._index.get(block_hash)
            if entry is not None:
                self._index.move_to_end(block_hash)
        if copy is not None:
            return copy
        if entry is None:
            return None
        parsed = self._read_record(entry, block_hash)  # the payload only: lineage is read at rescan
        if parsed is None:
            with self._lock:
                self.num_checksum_failures += 1
                if self._index.get(block_hash) == entry:
                    self._drop_locked(block_hash)
            return None
        return parsed[0]

    def _read_record(self, entry: Entry, block_hash: bytes, *, want_lineage: bool = False
                     ) -> tuple[bytearray, tuple | None] | None:  # fmt: skip
        """(payload, lineage) of the record an entry names, verified; None when unreadable."""
        record = bytearray(entry.record_length)
        try:
            with open(os.path.join(self.directory, segment_name(entry.segment)), "rb", buffering=0) as file:
                num_read = os.preadv(file.fileno(), [record], entry.offset)
        except OSError:
            return None
        parsed = self._parse(memoryview(record)[:num_read], 0, want_lineage=want_lineage)
        if parsed is None or parsed[0] != block_hash or len(parsed[1]) != entry.length or parsed[2] != num_read:
            return None
        return parsed[1], parsed[3]

    def _parse(self, data, at: int, *, want_lineage: bool = True) -> tuple[bytes, bytearray, int, tuple | None] | None:
        """(block hash, verified payload, record length, lineage) of the record at `at`, or None if torn/corrupt."""
        if len(data) - at < HEADER.size:
            return None
        magic, cipher_len, block_hash, nonce, checksum, parent, num_tokens, token_nonce = HEADER.unpack_from(data, at)
        payload_end = at + HEADER.size + cipher_len
        end = payload_end + (4 * num_tokens + TAG_BYTES if num_tokens else 0)
        if magic != MAGIC or cipher_len < TAG_BYTES or end > len(data):
            return None
        payload = bytearray(cipher_len - TAG_BYTES)
        lineage = None
        try:
            aad = _aad(block_hash, parent, num_tokens)
            self._aead.decrypt_into(nonce, data[at + HEADER.size : payload_end], b"kv" + aad, payload)
            if num_tokens and want_lineage:
                tokens = self._aead.decrypt(token_nonce, bytes(data[payload_end:end]), b"tk" + aad)
                lineage = (parent, np.frombuffer(tokens, dtype="<i4").copy())
        except InvalidTag:
            return None
        if not verify_block(checksum, payload):
            return None
        return block_hash, payload, end - at, lineage

    # ---- writes ---------------------------------------------------------------------------------------------------
    def store(self, block_hash: bytes, payload: bytearray, checksum: int, lineage: tuple | None = None, *,
              owned: bool = True) -> list:  # fmt: skip
        """Queue a block for the writer thread (no I/O here); readable at once from the pending set. `lineage`:
        (parent hash, tokens), kept in the record. With `owned`, the store zeroes `payload` once written or
        forgotten (the caller lets go of it). Returns [] (the SSD is the last tier: overflow is dropped)."""
        if len(payload) > self.capacity_bytes or self._closed:
            return self._let_go([payload] if owned else [])
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return self._let_go([payload] if owned else [])
            if len(self._pending) >= MAX_PENDING_BLOCKS:  # the disk is behind: bound the memory it holds
                self.num_dropped_writes += 1
                return self._let_go([payload] if owned else [])
            self._pending[block_hash] = _Pending(payload, checksum, lineage, owned)
        self._queue.put(block_hash)
        return []

    @staticmethod
    def _let_go(payloads) -> list:
        for payload in payloads:
            zero(payload)
        return []

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH and not self._queue.empty():
                batch.append(self._queue.get())
            hashes = [h for h in batch if h is not None]
            try:
                if hashes:
                    self._write_batch(hashes)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(hashes) < len(batch):  # the stop sentinel: everything queued before it is written
                return

    def _write_batch(self, hashes: list[bytes]) -> None:
        written: list[tuple[bytes, _Pending, Entry]] = []
        for block_hash in hashes:
            with self._lock:
                pending = self._pending.get(block_hash)
                if pending is not None:
                    self._in_write.add(block_hash)
            if pending is not None and not self._closed:
                written.append((block_hash, pending, self._append(block_hash, pending)))
            elif pending is not None:
                written.append((block_hash, pending, None))
        if self._segment_fd is not None:
            os.fsync(self._segment_fd)
        with self._lock:
            for block_hash, pending, entry in written:
                self._in_write.discard(block_hash)
                if self._pending.get(block_hash) is pending:  # not forgotten while it was written
                    del self._pending[block_hash]
                    if entry is not None:
                        self._index_locked(block_hash, entry)
                if pending.owned:
                    zero(pending.payload)
            while self.bytes_resident > self.capacity_bytes:
                self._drop_locked(next(iter(self._index)))
            if self._segment_fd is not None:
                self._committed_end[self._segment] = os.fstat(self._segment_fd).st_size
        if not self._closed:
            self._commit_index()
            self._delete_dead_segments()

    def _index_locked(self, block_hash: bytes, entry: Entry) -> None:
        self._index[block_hash] = entry
        self._segment_live[entry.segment] = self._segment_live.get(entry.segment, 0) + 1
        self.bytes_resident += entry.length

    def _append(self, block_hash: bytes, pending: _Pending) -> Entry:
        payload = pending.payload
        assert verify_block(pending.checksum, payload), "a block corrupted in memory before it reached the SSD"
        if self._segment_fd is None or os.fstat(self._segment_fd).st_size >= self.segment_bytes:
            self._open_next_segment()
        parent, tokens = pending.lineage if pending.lineage is not None else (NO_PARENT, np.zeros(0, np.int32))
        token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
        nonce, token_nonce = os.urandom(12), os.urandom(12)
        payload_end = HEADER.size + len(payload) + TAG_BYTES
        record = bytearray(payload_end + (len(token_bytes) + TAG_BYTES if len(tokens) else 0))
        HEADER.pack_into(record, 0, MAGIC, len(payload) + TAG_BYTES, block_hash, nonce, pending.checksum, bytes(parent),
                         len(tokens), token_nonce)  # fmt: skip
        aad = _aad(block_hash, bytes(parent), len(tokens))
        self._aead.encrypt_into(nonce, payload, b"kv" + aad, memoryview(record)[HEADER.size : payload_end])
        if len(tokens):
            self._aead.encrypt_into(token_nonce, token_bytes, b"tk" + aad, memoryview(record)[payload_end:])
        offset = os.fstat(self._segment_fd).st_size
        _write_all(self._segment_fd, record)
        return Entry(self._segment, offset, len(payload), len(record))

    def _open_next_segment(self) -> None:
        if self._segment_fd is not None:
            os.fsync(self._segment_fd)
            os.close(self._segment_fd)
            self._segment += 1
        path = os.path.join(self.directory, segment_name(self._segment))
        self._segment_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _fsync_directory(self.directory)

    def _drop_locked(self, block_hash: bytes) -> None:
        entry = self._index.pop(block_hash)
        self.bytes_resident -= entry.length
        self._segment_live[entry.segment] -= 1
        self._lineage.pop(block_hash, None)

    def _delete_dead_segments(self) -> None:
        with self._lock:
            dead = [s for s, live in self._segment_live.items() if live == 0 and s != self._segment]
            for segment in dead:
                del self._segment_live[segment]
                self._committed_end.pop(segment, None)
        for segment in dead:
            _unlink_quietly(os.path.join(self.directory, segment_name(segment)))

    # ---- forgetting -----------------------------------------------------------------------------------------------
    def discard(self, hashes) -> int:
        """Forget these blocks now (no I/O: `sync` makes it durable); returns how many were here."""
        removed = 0
        with self._lock:
            for block_hash in hashes:
                removed += self._forget_locked(block_hash)
        return removed

    def _forget_locked(self, block_hash: bytes) -> int:
        pending = self._pending.pop(block_hash, None)
        if pending is not None and pending.owned and block_hash not in self._in_write:
            zero(pending.payload)  # the writer zeroes what it is appending right now
        if block_hash in self._index:
            self._drop_locked(block_hash)
            return 1
        return int(pending is not None)

    def clear(self) -> int:
        """Forget every block (no I/O: `sync` makes it durable); returns how many there were."""
        with self._lock:
            return sum(self._forget_locked(h) for h in list(self._index) + list(self._pending))

    def sync(self) -> None:
        """Make what was forgotten durable: wait for the writer, commit the index, delete dead segments."""
        if self._closed:
            return
        self.flush()
        self._commit_index()
        self._delete_dead_segments()

    # ---- the index ------------------------------------------------------------------------------------------------
    def _commit_index(self) -> None:
        """Write the live entries (temp file, fsync, rename, fsync dir): a crash leaves the old or the new index."""
        with self._lock:
            document = {
                "version": 1,
                "entries": [[h.hex(), e.segment, e.offset, e.length, e.record_length] for h, e in self._index.items()],
                "committed_end": {str(s): end for s, end in self._committed_end.items()},
            }
        path = os.path.join(self.directory, INDEX_NAME)
        with open(path + ".tmp", "w") as file:
            json.dump(document, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(path + ".tmp", path)
        _fsync_directory(self.directory)

    def rescan(self) -> None:
        """Rebuild the index from disk, verifying every block (warm restart); drops torn and corrupt records."""
        indexed, committed_end = self._load_index()
        for block_hash, entry in indexed:
            parsed = self._read_record(entry, block_hash, want_lineage=True)
            self._admit(block_hash, entry, *(parsed if parsed is not None else (None, None)))
        for segment in self._segments_on_disk():
            self._scan_tail(segment, committed_end.get(segment, 0))
        with self._lock:
            while self.bytes_resident > self.capacity_bytes:
                self._drop_locked(next(iter(self._index)))
        for segment in self._segments_on_disk():
            if not self._segment_live.get(segment):
                self._segment_live.pop(segment, None)
                _unlink_quietly(os.path.join(self.directory, segment_name(segment)))
            else:
                self._committed_end[segment] = os.path.getsize(os.path.join(self.directory, segment_name(segment)))
        self._commit_index()

    def _admit(self, block_hash: bytes, entry: Entry, payload: bytearray | None, lineage: tuple | None) -> None:
        with self._lock:
            if payload is None or len(payload) != entry.length:
                self.num_checksum_failures += 1
                return
            zero(payload)  # only its validity mattered
            if block_hash in self._index:
                return
            self._index_locked(block_hash, entry)
            if lineage is not None:
                self._lineage[block_hash] = lineage
            self.num_rescanned_blocks += 1

    def _scan_tail(self, segment: int, start: int) -> None:
        """Admit the records after a segment's committed end (written after the last index commit)."""
        with open(os.path.join(self.directory, segment_name(segment)), "rb") as file:
            data = memoryview(file.read())
        at = start
        while at < len(data):
            parsed = self._parse(data, at)
            if parsed is None:
                self.num_checksum_failures += 1  # a torn or corrupt record: the rest of this segment is not trusted
                return
            block_hash, payload, record_length, lineage = parsed
            self._admit(block_hash, Entry(segment, at, len(payload), record_length), payload, lineage)
            at += record_length

    def _load_index(self) -> tuple[list[tuple[bytes, Entry]], dict[int, int]]:
        try:
            with open(os.path.join(self.directory, INDEX_NAME)) as file:
                document = json.load(file)
            entries = [(bytes.fromhex(h), Entry(int(s), int(o), int(n), int(r))) for h, s, o, n, r in document["entries"]]
            return entries, {int(s): int(end) for s, end in document["committed_end"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return [], {}

    def _segments_on_disk(self) -> list[int]:
        names = [n for n in os.listdir(self.directory) if n.startswith("seg-") and n.endswith(".log")]
        return sorted(int(n[4:-4]) for n in names)

    # ---- lifetime -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Write what is queued, then stop the writer (the directory stays: a later provisioning rescans it)."""
        if self._closed:
            return
        self._queue.put(None)
        self._writer.join()
        self._closed = True
        if self._segment_fd is not None:
            os.close(self._segment_fd)
            self._segment_fd = None

    def wipe(self) -> int:
        """Stop writing and delete the directory (erasure); returns the bytes that were resident."""
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        if self._segment_fd is not None:
            os.close(self._segment_fd)
            self._segment_fd = None
        with self._lock:
            resident = self.bytes_resident
            for pending in self._pending.values():
                if pending.owned:
                    zero(pending.payload)
            self._index.clear()
            self._pending.clear()
            self._lineage.clear()
            self.bytes_resident = 0
        shutil.rmtree(self.directory, ignore_errors=True)
        return resident

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_resident == sum(e.length for e in self._index.values()) <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class _Pending:
    payload: bytearray
    checksum: int
    lineage: tuple | None  # (parent hash, tokens)
    owned: bool  # zero the payload once written or forgotten


def _aad(block_hash: bytes, parent: bytes, num_tokens: int) -> bytes:
    return AAD_PREFIX + bytes(block_hash) + bytes(parent) + struct.pack("<I", num_tokens)


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
