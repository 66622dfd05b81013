"""Lower tiers of one cache: host DRAM, then encrypted SSD segments (gpu_node/ssd_store.py).

A cold, unheld, *full* block the device pool evicts is demoted (its bytes copied out under the cache lock, before
the evicting writer overwrites them) into DRAM; DRAM overflow (LRU) goes to the SSD store's writer thread. Partial
tails stay on the device only. A get/acquire whose prefix continues past the device tier into lower tiers promotes
that run of blocks back into the device pool (checksum verified; a mismatch drops the block, counts a failure and
ends the run: a miss, never wrong KV), so readers always read the device pool as before.

Blocks are named by their chained keyed hash (gpu_node/block_hash.py): equal hash, equal prefix, so a lower-tier
block is installed under the request's own chain (its tokens are the request's tokens). A block's *payload* is its
pool bytes followed by its scales bytes (quantized storage), exactly what gpu_node/checksum.py sums.

Tiering: DRAM is exclusive (a promoted block leaves DRAM), SSD is inclusive (a block stays on SSD after promotion,
so a later demotion of the same hash costs no write, and a restart finds it: warm restart).

Lineage: every demotion also records the block's (parent hash, tokens) in `LowerTiers.lineage`, in memory only, so
a migration (gpu_node/block_transfer.py) can send lower-tier blocks with the names the target checks. Entries of
blocks that left every tier are pruned lazily (`present_lineage`, and when the map outgrows the tiers). Blocks found by
an SSD rescan (warm restart) have no lineage: they are served by hash but not migrated.

Lock order: cache lock -> DRAM lock -> SSD index lock. No lock of this module is held during SSD I/O, and no lock
is shared between caches.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections import OrderedDict

import numpy as np
import torch

from gpu_node.block_hash import HASH_NUM_BYTES
from gpu_node.checksum import block_checksum, verify_block


def block_payloads(pool: torch.Tensor, scales: torch.Tensor | None, block_ids: list[int]) -> list[bytearray]:
    """Copies of the stored bytes of blocks (pool bytes, then scales bytes), one bytearray each: one copy per block
    (device to host when the pool is on a device)."""
    pool_bytes = _block_nbytes(pool)
    scale_bytes = _block_nbytes(scales) if scales is not None else 0
    payloads = []
    for block_id in block_ids:
        payload = bytearray(pool_bytes + scale_bytes)
        target = torch.frombuffer(payload, dtype=torch.uint8)
        target[:pool_bytes].copy_(_bytes_of(pool[block_id]))
        if scales is not None:
            target[pool_bytes:].copy_(_bytes_of(scales[block_id]))
        payloads.append(payload)
    return payloads


def write_payloads(pool: torch.Tensor, scales: torch.Tensor | None, block_ids: list[int], payloads) -> None:
    """Store payloads (block_payloads' format) into blocks of the pool (and scales): one copy per block."""
    pool_bytes = _block_nbytes(pool)
    for block_id, payload in zip(block_ids, payloads):
        assert len(payload) == pool_bytes + (_block_nbytes(scales) if scales is not None else 0), "a foreign payload"
        source = torch.frombuffer(payload, dtype=torch.uint8)
        _bytes_of(pool[block_id]).copy_(source[:pool_bytes])
        if scales is not None:
            _bytes_of(scales[block_id]).copy_(source[pool_bytes:])


def _block_nbytes(storage: torch.Tensor) -> int:
    return storage[0].numel() * storage.element_size()


def _bytes_of(block: torch.Tensor) -> torch.Tensor:
    """A uint8 view of one (contiguous) block of the pool or scales: writes through it land in the pool."""
    return block.view(-1).view(torch.uint8)


class DramTier:
    """Host-memory blocks of one cache, LRU, keyed by block hash: hash -> (payload, xxh3 checksum of payload).

    Invariant: bytes_resident == sum of len(payload) over entries <= capacity_bytes (checked by check_invariants).
    Payloads are bytearrays owned here, so wipe() can overwrite them with zeros.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[bytes, tuple[bytearray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_resident = 0
        self.num_checksum_failures = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def put(self, block_hash: bytes, payload: bytearray, checksum: int) -> list[tuple[bytes, bytearray, int]]:
        """Insert (most recently used); returns the LRU entries pushed out to stay within capacity."""
        assert len(payload) <= self.capacity_bytes
        pushed_out = []
        with self._lock:
            previous = self._entries.pop(block_hash, None)
            if previous is not None:
                self.bytes_resident -= len(previous[0])
            while self.bytes_resident + len(payload) > self.capacity_bytes:
                old_hash, (old_payload, old_checksum) = self._entries.popitem(last=False)
                self.bytes_resident -= len(old_payload)
                pushed_out.append((old_hash, old_payload, old_checksum))
            self._entries[block_hash] = (payload, checksum)
            self.bytes_resident += len(payload)
        return pushed_out

    def peek(self, block_hash: bytes) -> bytearray | None:
        """A verified copy of a block's payload, leaving it in place (LRU order unchanged); None if absent or
        corrupt (a corrupt entry is dropped and counted)."""
        with self._lock:
            entry = self._entries.get(block_hash)
            copy = bytearray(entry[0]) if entry is not None else None
        if entry is None or verify_block(entry[1], copy):
            return copy
        with self._lock:
            if self._entries.get(block_hash) is entry:
                del self._entries[block_hash]
                self.bytes_resident -= len(entry[0])
            self.num_checksum_failures += 1
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, block_hash: bytes) -> bytearray | None:
        """Remove and return a block's payload if present and intact; a corrupt one is dropped and counted."""
        with self._lock:
            entry = self._entries.pop(block_hash, None)
            if entry is None:
                return None
            self.bytes_resident -= len(entry[0])
        payload, checksum = entry
        if not verify_block(checksum, payload):
            with self._lock:
                self.num_checksum_failures += 1
            return None
        return payload

    def wipe(self) -> int:
        """Zero every payload's bytes and forget them (erasure); returns the bytes that were resident."""
        with self._lock:
            resident = self.bytes_resident
            for payload, _ in self._entries.values():
                payload[:] = bytes(len(payload))
            self._entries.clear()
            self.bytes_resident = 0
        return resident

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_resident == sum(len(p) for p, _ in self._entries.values()) <= self.capacity_bytes


class LowerTiers:
    """The tiers below one cache's device pool: DRAM (capacity may be 0) and an optional SsdStore."""

    def __init__(self, dram_bytes: int, ssd=None):
        self.dram = DramTier(dram_bytes)
        self.ssd = ssd
        self.lineage: dict[bytes, tuple[bytes, np.ndarray]] = {}  # hash -> (parent hash, tokens): see module doc

    def demote(self, block_hash: bytes, payload: bytearray, lineage: tuple[bytes, np.ndarray] | None = None) -> None:
        """Keep an evicted full block: DRAM when it fits, its overflow (or the block itself) to SSD, else drop.
        `lineage` (parent hash, tokens) is recorded first, so a block in a tier always has it when one was given."""
        if lineage is not None:
            self.lineage[block_hash] = (bytes(lineage[0]), np.array(lineage[1], dtype=np.int32))
            if len(self.lineage) > 2 * self._num_blocks() + 1024:
                self.present_lineage()
        checksum = block_checksum(payload)
        if len(payload) <= self.dram.capacity_bytes:
            for pushed in self.dram.put(block_hash, payload, checksum):
                self._to_ssd(*pushed)
        else:
            self._to_ssd(block_hash, payload, checksum)

    def _to_ssd(self, block_hash: bytes, payload: bytearray, checksum: int) -> None:
        if self.ssd is not None:
            self.ssd.write_async(block_hash, payload, checksum)

    def _num_blocks(self) -> int:
        ssd = self.ssd
        return len(self.dram) + (len(ssd._index) + len(ssd._pending) if ssd is not None else 0)

    def present_lineage(self) -> dict[bytes, tuple[bytes, np.ndarray]]:
        """Lineage of the blocks some tier holds now (entries of blocks gone from every tier are pruned)."""
        for block_hash in [h for h in self.lineage if not self.has(h)]:
            self.lineage.pop(block_hash, None)
        return dict(self.lineage)

    def peek(self, block_hash: bytes) -> bytearray | None:
        """A verified copy of a block's payload read straight from DRAM or SSD: nothing is promoted or moved."""
        payload = self.dram.peek(block_hash)
        if payload is None and self.ssd is not None:
            payload = self.ssd.read(block_hash)
        return payload

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.dram or (self.ssd is not None and self.ssd.contains(block_hash))

    def count_run(self, hashes: list[bytes]) -> int:
        """How many leading hashes are held by some lower tier (no verification: a pure query)."""
        count = 0
        for block_hash in hashes:
            if not self.has(block_hash):
                break
            count += 1
        return count

    def fetch_run(self, hashes: list[bytes]) -> list[bytearray]:
        """Verified payloads of the leading run of `hashes` found in lower tiers (DRAM entries are taken out)."""
        payloads = []
        for block_hash in hashes:
            payload = self.dram.take(block_hash)
            if payload is None and self.ssd is not None:
                payload = self.ssd.read(block_hash)
            if payload is None:
                break
            payloads.append(payload)
        return payloads

    def resident_bytes(self) -> dict[str, int]:
        return {"dram": self.dram.bytes_resident, "ssd": self.ssd.bytes_resident if self.ssd is not None else 0}

    def checksum_failures(self) -> dict[str, int]:
        return {"dram": self.dram.num_checksum_failures,
                "ssd": self.ssd.num_checksum_failures if self.ssd is not None else 0}  # fmt: skip

    def wipe(self) -> int:
        """Erasure: zero DRAM, delete the SSD directory; returns the bytes that were resident in both."""
        resident = self.dram.wipe()
        if self.ssd is not None:
            resident += self.ssd.destroy()
        return resident

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()


# ---- the hooks PagedKVCache calls (under its lock where said) -------------------------------------------------------
def demote_evicted(cache) -> None:
    """Copy out and demote the full blocks the last allocation evicted. Call under the cache lock, right after the
    allocation and before anything writes the blocks it handed out."""
    evicted = cache._blocks.evicted
    if not evicted:
        return
    block_ids = [block_id for block_id, _, _ in evicted]
    lineages = [(parent, cache._blocks.block_tokens[block_id].copy()) for block_id, _, parent in evicted]
    hashes = [block_hash for _, block_hash, _ in evicted]
    evicted.clear()
    for block_hash, payload, lineage in zip(hashes, block_payloads(cache.pool, cache.scales, block_ids), lineages):
        cache._tiers.demote(block_hash, payload, lineage)


def _split(chain: bytes, start: int) -> list[bytes]:
    return [chain[i : i + HASH_NUM_BYTES] for i in range(start * HASH_NUM_BYTES, len(chain), HASH_NUM_BYTES)]


def lookup_beyond_device(cache, tokens: np.ndarray, device_tokens: int) -> int:
    """lookup() with lower tiers: the device match, or its full blocks followed by the lower tiers' run if longer."""
    chain = cache._hasher.chain(tokens)
    with cache._lock:
        num_full = cache._num_cached_full_blocks(chain)
    num_lower = cache._tiers.count_run(_split(chain, num_full))
    return max(device_tokens, (num_full + num_lower) * cache.block_size)


def promote(cache, tokens: np.ndarray) -> int:
    """Bring the run of lower-tier blocks continuing the device prefix of `tokens` into the device pool; returns
    how many blocks were installed. Lower-tier I/O happens without the cache lock."""
    chain = cache._hasher.chain(tokens)
    with cache._lock:
        num_full = cache._num_cached_full_blocks(chain)
    wanted = _split(chain, num_full)
    if not wanted or not cache._tiers.has(wanted[0]):
        return 0
    payloads = cache._tiers.fetch_run(wanted)
    if not payloads:
        return 0
    with cache._lock:
        return _install(cache, chain, num_full, tokens, wanted[: len(payloads)], payloads)


def _install(cache, chain: bytes, num_full: int, tokens: np.ndarray, hashes: list[bytes], payloads) -> int:
    """Under the cache lock: allocate device blocks after the (held) device prefix, write the payloads, publish."""
    blocks, block_size = cache._blocks, cache.block_size
    if cache._num_cached_full_blocks(chain) != num_full:  # the device prefix changed meanwhile: keep the blocks
        _demote_back(cache, chain, tokens, num_full, hashes, payloads)
        return 0
    prefix_ids = [blocks.cached_hash_to_block[h] for h in _split(chain[: num_full * HASH_NUM_BYTES], 0)]
    blocks.hold(prefix_ids)  # so the allocation cannot evict the prefix the new blocks hang off
    block_ids = blocks.allocate(len(payloads))
    demote_evicted(cache)
    installed = len(block_ids)
    if installed:
        write_payloads(cache.pool, cache.scales, block_ids, payloads[:installed])
        parent = chain[(num_full - 1) * HASH_NUM_BYTES : num_full * HASH_NUM_BYTES] if num_full else cache._hasher.root
        segment = tokens[num_full * block_size : (num_full + installed) * block_size]
        blocks.publish_chain(block_ids, parent, segment, hashes[:installed])
    blocks.release(block_ids[::-1] + prefix_ids[::-1])
    _demote_back(cache, chain, tokens, num_full + installed, hashes[installed:], payloads[installed:])
    return installed


def _demote_back(cache, chain: bytes, tokens: np.ndarray, first: int, hashes: list[bytes], payloads) -> None:
    """Demote blocks first, first+1, ... of `chain` again, with their lineage."""
    size = cache.block_size
    for i, (block_hash, payload) in enumerate(zip(hashes, payloads), start=first):
        parent = chain[(i - 1) * HASH_NUM_BYTES : i * HASH_NUM_BYTES] if i else cache._hasher.root
        cache._tiers.demote(block_hash, payload, (bytes(parent), tokens[i * size : (i + 1) * size]))


# ---- setting tiers up for a hosted cache (the registry calls these) -------------------------------------------------
SSD_DIR_ENV = "KCAAS_NODE_SSD_DIR"
OWNER_FILE = "tenant"  # the tenant id of the cache a directory belongs to: purge_tenant finds unhosted leftovers by it
_SAFE_CACHE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def default_ssd_root(environ=os.environ) -> str:
    """KCAAS_NODE_SSD_DIR, else var/kcaas-ssd under the agent's working directory."""
    return environ.get(SSD_DIR_ENV) or os.path.join(os.getcwd(), "var", "kcaas-ssd")


def cache_directory(ssd_root: str, cache_id: str) -> str:
    if not _SAFE_CACHE_ID.fullmatch(cache_id):
        raise ValueError("a cache id must be a plain file name to name its SSD directory")
    return os.path.join(ssd_root, cache_id)


def open_tiers(ssd_root: str, cache_id: str, tenant_id: str, capacity: dict, block_bytes: int,
               ssd_key: bytes | None) -> LowerTiers | None:  # fmt: skip
    """The lower tiers a capacity asks for (None when it asks for none that can hold a block). The SSD tier needs
    a data key; opening an existing directory rescans it (warm restart)."""
    from gpu_node.ssd_store import SsdStore  # cryptography: only nodes with an SSD tier load it

    dram_bytes = int(capacity.get("dram", 0)) if int(capacity.get("dram", 0)) >= block_bytes else 0
    ssd_bytes = int(capacity.get("ssd", 0))
    store = None
    if ssd_key is not None and ssd_bytes >= block_bytes:
        directory = cache_directory(ssd_root, cache_id)
        store = SsdStore(directory, ssd_key, ssd_bytes)
        _write_owner(directory, tenant_id)
    if not dram_bytes and store is None:
        return None
    return LowerTiers(dram_bytes, store)


def _write_owner(directory: str, tenant_id: str) -> None:
    path = os.path.join(directory, OWNER_FILE)
    with open(path + ".tmp", "w") as file:
        file.write(tenant_id)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def purge_tenant_directories(ssd_root: str, tenant_id: str) -> list[str]:
    """Delete every cache directory under `ssd_root` owned by the tenant (hosted or left from an earlier run)."""
    removed = []
    if not tenant_id or not os.path.isdir(ssd_root):
        return removed
    for name in sorted(os.listdir(ssd_root)):
        directory = os.path.join(ssd_root, name)
        try:
            with open(os.path.join(directory, OWNER_FILE)) as file:
                owner = file.read()
        except OSError:
            continue
        if owner == tenant_id:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(name)
    return removed
