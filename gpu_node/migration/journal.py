"""The target's durable record of an incoming migration, so a SIGKILLed target resumes without resends (no Django).

A cache provisioned with an SSD tier keeps, next to its segment files, `migration-in.journal`:

    header  MAGIC + 36-byte migration id (ascii)
    record  RECORD (parent, key, n tokens) + n int32 tokens   one per full block the listener verified and stored

The block's bytes themselves go to the cache's SsdStore (encrypted, checksummed, keyed by the block's chained
hash); the journal only adds what the store does not keep: the parent link and the token ids, without which a
block cannot be published in the device index again.

Invariants:
- `sync()` makes every block appended so far durable, store first then journal: a journal record names a block
  whose SSD record is already fsync'd and indexed (or was dropped by the store: replay then skips it);
- records are in the order the listener published the blocks, so each record's parent precedes it (or is the root);
- a journal written for another migration id is discarded when a new one opens it (a stale copy never counts);
- replay re-verifies everything (store: AES-GCM + xxh3; insert_block: checksum + chained hash), so a torn tail or a
  corrupt record is just a block that is sent again.
"""

from __future__ import annotations

import os
import struct
import threading

import numpy as np

from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.checksum import block_checksum
from gpu_node.migration import block_transfer as bt

JOURNAL_NAME = "migration-in.journal"
MAGIC = b"KMJ1"
ID_BYTES = 36
RECORD = struct.Struct("<16s16sI")  # parent, key, num tokens


class IncomingJournal:
    """One incoming migration's journal in the directory of the cache's SsdStore `ssd`."""

    def __init__(self, ssd, migration_id: str):
        self.ssd, self.migration_id = ssd, str(migration_id)
        self.path = os.path.join(ssd.directory, JOURNAL_NAME)
        self._lock = threading.Lock()
        self._unsynced = 0
        own, self._records = self._read_own()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if not own:
            self._restart_file()

    # ---- reading --------------------------------------------------------------------------------------------------
    def _header(self) -> bytes:
        return MAGIC + self.migration_id.encode().ljust(ID_BYTES)[:ID_BYTES]

    def _read_own(self) -> tuple[bool, list[tuple[BlockHash, BlockHash, np.ndarray]]]:
        """(is the file this migration's, its complete records); (False, []) when absent, torn or another's."""
        try:
            with open(self.path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return False, []
        if data[: len(MAGIC) + ID_BYTES] != self._header():
            return False, []
        records, at = [], len(MAGIC) + ID_BYTES
        while at + RECORD.size <= len(data):
            parent, key, num_tokens = RECORD.unpack_from(data, at)
            end = at + RECORD.size + 4 * num_tokens
            if end > len(data):
                break  # a torn tail: those blocks come again
            tokens = np.frombuffer(data[at + RECORD.size : end], dtype="<i4").copy()
            records.append((BlockHash(parent), BlockHash(key), tokens))
            at = end
        if at != len(data):  # cut the torn tail off before appending after it
            os.truncate(self.path, at)
        return True, records

    def _restart_file(self) -> None:
        os.ftruncate(self._fd, 0)
        os.write(self._fd, self._header())
        os.fsync(self._fd)

    def replay(self, engine) -> int:
        """Publish the journaled blocks the store still holds into `engine`'s device index; returns how many."""
        restored = 0
        for parent, key, tokens in self._records:
            payload = self.ssd.read(key)
            if payload is None:
                continue
            verdict = bt.insert_block(engine, parent, key, True, tokens, block_checksum(payload), memoryview(payload))
            restored += verdict in ("stored", "have")
        return restored

    # ---- writing --------------------------------------------------------------------------------------------------
    def write_through(self, engine, parent: BlockHash, key: BlockHash, tokens: np.ndarray) -> bool:
        """Queue a just-stored full block for the SSD (through the engine, with its lineage, so a delete finds it)
        and journal it (durable at the next sync()). The bytes come from the device pool, or from the lower tier a
        tiered target kept the block in; False when neither holds it any more (it is then simply not journaled: sent
        again after a restart)."""
        if not engine.exchange.write_through(bytes(parent), bytes(key), np.asarray(tokens, dtype=np.int32)):
            return False
        record = RECORD.pack(bytes(parent), bytes(key), len(tokens)) + np.ascontiguousarray(tokens, "<i4").tobytes()
        with self._lock:
            os.write(self._fd, record)
            self._unsynced += 1
        return True

    @property
    def unsynced(self) -> int:
        return self._unsynced

    def sync(self) -> None:
        """Store first (segment fsync + index commit), then the journal: afterwards every record is durable."""
        with self._lock:
            if not self._unsynced:
                return
            self.ssd.flush()
            os.fsync(self._fd)
            self._unsynced = 0

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
