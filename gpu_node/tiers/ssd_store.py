"""The SSD tier of one cache: encrypted blocks in append-only segment files, an index that survives crashes.

Directory `<root>/<cache id>/` (root: KCAAS_NODE_SSD_DIR):

    seg-000001.log ...   records, appended by this store's writer thread only, fsync'd per batch
    index.json           the live entries as of the last commit: written to index.json.tmp, fsync, rename, fsync dir
    lock                 flock'd by the one live store of the directory (gpu_node/tiers/cache_dirs.py `hold`)

Records: gpu_node/tiers/ssd_records.py (AES-GCM of the payload and of its lineage, bound to the block's name). The data
key (32 bytes) comes from the control plane in provision_cache and lives in this process's memory only: without it
the files are noise.

One store per directory: the constructor takes the directory's lock (cache_dirs.DirectoryInUse when another live
store, of this process or another, holds it); close and wipe release it, and so does the death of the process.

Writer failure: an error in the writer thread (a disk error, the directory removed under it) is logged at
CRITICAL and fails the store for good: flush and sync raise SsdWriterFailed instead of hanging or returning as if
the blocks were durable, later `store` calls raise it (the payload is zeroed first), and blocks still queued are
forgotten (zeroed); what the last index commit named stays readable. A new provisioning opens a fresh store.

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
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.engine.block_hash import BlockHash, BlockLineage, PushedOut
from gpu_node.engine.checksum import verify_block
from gpu_node.engine.zeroing import zero
from gpu_node.errors import NodeError
from gpu_node.tiers import cache_dirs, ssd_records
from gpu_node.tiers.durable_file import CommittedFile, fsync_directory
from gpu_node.tiers.ssd_records import HEADER, MAGIC, NO_PARENT  # noqa: F401 - the record format, as tests name it

log = logging.getLogger(__name__)
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


class SsdWriterFailed(NodeError, RuntimeError):
    """The store's writer thread failed: nothing more is written (flush, sync and store raise this)."""


def segment_name(segment: int) -> str:
    return f"seg-{segment:06d}.log"


class SsdStore:
    """The SSD tier of one cache (implements gpu_node.tiers.lower_tiers.Tier)."""

    def __init__(self, directory: str, data_key: bytes, capacity_bytes: int, *, segment_bytes: int = SEGMENT_BYTES):
        if not isinstance(data_key, bytes) or len(data_key) != DATA_KEY_BYTES:
            raise ValueError(f"the SSD data key must be {DATA_KEY_BYTES} bytes")
        self.directory = directory
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = segment_bytes
        self._aead = AESGCM(data_key)
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, Entry] = OrderedDict()  # LRU first
        self._pending: dict[BlockHash, _Pending] = {}  # queued or being written: served from here
        self._in_write: dict[BlockHash, _Pending] = {}  # blocks the writer is appending now (it zeroes them after)
        self._lineage: dict[BlockHash, BlockLineage] = {}  # found by rescan: hash -> (parent, tokens)
        self._segment_live: dict[int, int] = {}  # segment -> live entries
        self._committed_end: dict[int, int] = {}  # segment -> bytes fsync'd
        self.bytes_resident = 0
        self.num_checksum_failures = 0
        self.num_rescanned_blocks = 0
        self.num_dropped_writes = 0
        self._failure: BaseException | None = None  # what stopped the writer, once it failed
        self._lock_fd: int | None = cache_dirs.hold(directory)  # DirectoryInUse: another live store holds it
        self._index_file = CommittedFile(os.path.join(directory, INDEX_NAME))
        self._index_file.remove_stale_temp_files()  # this store holds the directory: no other writer is running
        try:
            self.rescan()
        except BaseException:
            cache_dirs.release(self._lock_fd)
            raise
        self._segment = max(self._committed_end, default=0) + 1  # never append after a possibly torn tail
        self._segment_fd: int | None = None
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name=f"ssd-writer-{os.path.basename(directory)}", daemon=True
        )
        self._writer.start()

    # ---- reads ----------------------------------------------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index or block_hash in self._pending

    def __len__(self) -> int:
        return len(self._index) + len(self._pending)

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index) + [h for h in self._pending if h not in self._index]

    def lineages(self) -> dict[BlockHash, BlockLineage]:
        """(parent, tokens) of the blocks a rescan found with their lineage (warm restart)."""
        with self._lock:
            return {h: lineage for h, lineage in self._lineage.items() if h in self._index}

    def read(self, block_hash: BlockHash) -> bytearray | None:
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

    def _read_record(
        self, entry: Entry, block_hash: BlockHash, *, want_lineage: bool = False
    ) -> tuple[bytearray, tuple | None] | None:
        """(payload, lineage) of the record an entry names, verified; None when unreadable."""
        record = bytearray(entry.record_length)
        try:
            with open(os.path.join(self.directory, segment_name(entry.segment)), "rb", buffering=0) as file:
                num_read = os.preadv(file.fileno(), [record], entry.offset)
        except OSError:
            return None
        parsed = ssd_records.decode(self._aead, memoryview(record)[:num_read], 0, want_lineage=want_lineage)
        if parsed is None or parsed[0] != block_hash or len(parsed[1]) != entry.length or parsed[2] != num_read:
            return None
        return parsed[1], parsed[3]

    # ---- writes ---------------------------------------------------------------------------------------------------
    def store(
        self,
        block_hash: BlockHash,
        payload: bytearray,
        checksum: int,
        lineage: BlockLineage | None = None,
        *,
        owned: bool = True,
    ) -> list[PushedOut]:
        """Queue a block for the writer thread (no I/O here); readable at once from the pending set. `lineage`:
        (parent hash, tokens), kept in the record. With `owned`, the store zeroes `payload` once written or
        forgotten (the caller lets go of it). Returns [] (the SSD is the last tier: overflow is dropped). Raises
        SsdWriterFailed (the payload zeroed when owned) once the writer failed."""
        if self._failure is not None:
            self._let_go([payload] if owned else [])
            raise self._failed()
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
        """Wait until every queued block is written (or dropped); SsdWriterFailed when the writer failed."""
        self._queue.join()
        if self._failure is not None:
            raise self._failed()

    def _failed(self) -> SsdWriterFailed:
        return SsdWriterFailed(f"the SSD writer of {self.directory} failed: {self._failure!r}")

    def _write_loop(self) -> None:
        """Write batches until the stop sentinel. After a failure it only forgets what is queued (so nothing
        waiting on the queue hangs); the failure is recorded before the batch is marked done, so a flush that
        returns because of it sees it."""
        while True:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH and not self._queue.empty():
                batch.append(self._queue.get())
            hashes = [h for h in batch if h is not None]
            try:
                if hashes and self._failure is None:
                    self._write_batch(hashes)
            except BaseException as error:  # noqa: BLE001 - reported, and it fails whoever waits on the writer
                self._fail(error)
            finally:
                if self._failure is not None:
                    self._forget_unwritten(hashes)
                for _ in batch:
                    self._queue.task_done()
            if len(hashes) < len(batch):  # the stop sentinel: everything queued before it is written
                return

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        log.critical(
            "the SSD writer of %s died: %r. This cache's SSD tier takes no more blocks; flush, sync and "
            "store raise from now on",
            self.directory,
            error,
            exc_info=error,
        )

    def _forget_unwritten(self, hashes: Sequence[BlockHash]) -> None:
        """After a writer failure: drop (and zero) these queued or half-written blocks; they are never indexed."""
        with self._lock:
            for block_hash in hashes:
                for pending in (self._in_write.pop(block_hash, None), self._pending.pop(block_hash, None)):
                    if pending is not None and pending.owned:
                        zero(pending.payload)

    def _write_batch(self, hashes: Sequence[BlockHash]) -> None:
        written: list[tuple[BlockHash, _Pending, Entry | None]] = []  # None: closed meanwhile, not written
        for block_hash in hashes:
            with self._lock:
                pending = self._pending.get(block_hash)
                if pending is not None:
                    self._in_write[block_hash] = pending
            if pending is not None and not self._closed:
                written.append((block_hash, pending, self._append(block_hash, pending)))
            elif pending is not None:
                written.append((block_hash, pending, None))
        if self._segment_fd is not None:
            os.fsync(self._segment_fd)
        with self._lock:
            for block_hash, pending, entry in written:
                self._in_write.pop(block_hash, None)
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

    def _index_locked(self, block_hash: BlockHash, entry: Entry) -> None:
        self._index[block_hash] = entry
        self._segment_live[entry.segment] = self._segment_live.get(entry.segment, 0) + 1
        self.bytes_resident += entry.length

    def _append(self, block_hash: BlockHash, pending: _Pending) -> Entry:
        payload = pending.payload
        assert verify_block(pending.checksum, payload), "a block corrupted in memory before it reached the SSD"
        if self._segment_fd is None or os.fstat(self._segment_fd).st_size >= self.segment_bytes:
            self._open_next_segment()
        fd = self._segment_fd
        assert fd is not None, "a segment is open after _open_next_segment"
        record = ssd_records.encode(self._aead, block_hash, payload, pending.checksum, pending.lineage)
        offset = os.fstat(fd).st_size
        _write_all(fd, record)
        return Entry(self._segment, offset, len(payload), len(record))

    def _open_next_segment(self) -> None:
        if self._segment_fd is not None:
            os.fsync(self._segment_fd)
            os.close(self._segment_fd)
            self._segment += 1
        path = os.path.join(self.directory, segment_name(self._segment))
        self._segment_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fsync_directory(self.directory)

    def _drop_locked(self, block_hash: BlockHash) -> None:
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

    def _forget_locked(self, block_hash: BlockHash) -> int:
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
        """Write the live entries (durable_file: a temp file of its own, fsync, rename, fsync dir): a crash leaves
        the old or the new index. The writer thread (after a batch) and `sync` (after a delete or clear) both commit;
        the index file serializes them and snapshots inside, so the file always ends with the newest entries."""
        self._index_file.commit(self._index_document)

    def _index_document(self) -> bytes:
        with self._lock:
            document = {
                "version": 1,
                "entries": [[h.hex(), e.segment, e.offset, e.length, e.record_length] for h, e in self._index.items()],
                "committed_end": {str(s): end for s, end in self._committed_end.items()},
            }
        return json.dumps(document).encode()

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

    def _admit(
        self, block_hash: BlockHash, entry: Entry, payload: bytearray | None, lineage: BlockLineage | None
    ) -> None:
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
            parsed = ssd_records.decode(self._aead, data, at)
            if parsed is None:
                self.num_checksum_failures += 1  # a torn or corrupt record: the rest of this segment is not trusted
                return
            block_hash, payload, record_length, lineage = parsed
            self._admit(block_hash, Entry(segment, at, len(payload), record_length), payload, lineage)
            at += record_length

    def _load_index(self) -> tuple[list[tuple[BlockHash, Entry]], dict[int, int]]:
        try:
            with open(os.path.join(self.directory, INDEX_NAME)) as file:
                document = json.load(file)
            entries = [
                (BlockHash(bytes.fromhex(h)), Entry(int(s), int(o), int(n), int(r)))
                for h, s, o, n, r in document["entries"]
            ]
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
        cache_dirs.release(self._lock_fd)
        self._lock_fd = None

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
        if self._lock_fd is not None or not cache_dirs.held(self.directory):  # closed before: maybe another's now
            shutil.rmtree(self.directory, ignore_errors=True)  # still ours: no other store opens it meanwhile
        cache_dirs.release(self._lock_fd)
        self._lock_fd = None
        return resident

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_resident == sum(e.length for e in self._index.values()) <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class _Pending:
    payload: bytearray
    checksum: int
    lineage: BlockLineage | None  # (parent hash, tokens)
    owned: bool  # zero the payload once written or forgotten


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
