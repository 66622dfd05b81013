"""Lower tiers of one cache: host DRAM, encrypted SSD segments (gpu_node/tiers/ssd_store.py), then the fleet's network
store (gpu_node/tiers/network_tier.py) — storage only.

The engine facade (PagedKVCache, with its tier operations in gpu_node/engine/tier_moves.py) decides what moves when;
this module stores and forgets blocks by hash and never touches the cache's own state. Each tier implements `Tier`.

A cold, unheld, *full* block the device pool evicts is demoted (its bytes copied out under the cache lock, before
the evicting writer overwrites them) into DRAM; DRAM overflow (LRU) goes to the SSD store's writer thread. Partial
tails stay on the device only. A block's *payload* is its pool bytes followed by its scales bytes (quantized
storage), exactly what gpu_node/engine/checksum.py sums; every read is verified (a mismatch is a miss and a counter).

Tiering: DRAM is exclusive (a promoted block leaves DRAM), SSD is inclusive (a block stays on SSD after promotion,
so a later demotion of the same hash costs no write, and a restart finds it: warm restart). The network tier is
inclusive of both: every block demoted from the device is also queued for it (asynchronously, unless it holds the
block already), so the SSD's own eviction needs no read-back and a lost node loses only what was still queued. Its
index is completed by `probe` (the store's answer for hashes no tier knows), called without the cache lock.

Lineage: every lower-tier block has its (parent hash, tokens) in `LowerTiers.lineage` (a `Lineage`: also indexed
parent -> children). It is what delete/clear follow to remove a prefix and everything chained under it from every
tier, and what a migration sends. It is durable where the block is: SSD records carry it (encrypted), so a warm
restart rebuilds it.

Lock order: cache lock -> DRAM lock -> SSD index lock. No lock of this module is held during SSD I/O, and no lock
is shared between caches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from gpu_node.engine.block_hash import BlockHash, BlockLineage, PushedOut
from gpu_node.engine.checksum import block_checksum, verify_block
from gpu_node.engine.zeroing import zero
from gpu_node.tiers import cache_dirs


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


class Tier(Protocol):
    """One lower tier of one cache (DramTier, SsdStore): blocks named by their chained keyed hash.

    Invariants every tier keeps:
    - what `read`/`take` return is verified against the checksum given at `store` (a mismatch: None, the entry is
      dropped and counted in num_checksum_failures) — never wrong bytes;
    - `discard`/`clear` make blocks unreadable at once (no I/O: callable under the cache lock) and `sync` makes that
      durable (a restart does not bring them back); payload copies the tier owns are zeroed when forgotten;
    - after `wipe` no byte of any block stays in the tier's memory or files, and the tier stores nothing more;
    - bytes_resident == the payload bytes of the blocks it holds <= its capacity (check_invariants).
    """

    bytes_resident: int
    num_checksum_failures: int

    def contains(self, block_hash: BlockHash) -> bool:
        """Returns: whether the tier holds the block (no I/O)."""
        ...

    def hashes(self) -> list[BlockHash]:
        """Returns: the names of every block the tier holds."""
        ...

    def read(self, block_hash: BlockHash) -> bytearray | None:
        """Returns: a verified private copy of the block's payload (the caller zeroes it when done), or None when
        the tier lacks it or its bytes fail their checksum (then dropped and counted)."""
        ...

    def store(
        self, block_hash: BlockHash, payload: bytearray, checksum: int, lineage: BlockLineage | None
    ) -> list[PushedOut]:
        """Keep the block (the tier owns `payload` from now on).

        Returns: what was pushed out to stay within capacity, for the next tier ([] for the last tier, whose
        overflow is dropped and counted). Raises: SsdWriterFailed once an SSD tier's writer failed."""
        ...

    def discard(self, hashes) -> int:
        """Forget these blocks (no I/O; `sync` makes it durable). Returns: how many the tier held."""
        ...

    def clear(self) -> int:
        """Forget every block (no I/O; `sync` makes it durable). Returns: how many the tier held."""
        ...

    def sync(self) -> None:
        """Make what was forgotten durable. Raises: SsdWriterFailed once an SSD tier's writer failed."""
        ...

    def wipe(self) -> int:
        """Erase every byte of every block, in memory and in files; the tier stores nothing more. Returns: the bytes
        that were resident."""
        ...

    def check_invariants(self) -> None:
        """Raises: AssertionError when an invariant above does not hold."""
        ...

    def __len__(self) -> int: ...


class DramTier:
    """Host-memory blocks of one cache, LRU, keyed by block hash: hash -> (payload, xxh3 checksum of payload).

    Invariant: bytes_resident == sum of len(payload) over entries <= capacity_bytes (checked by check_invariants).
    Payloads are bytearrays owned here, so they are zeroed when forgotten (discard, clear, wipe).
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[BlockHash, tuple[bytearray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_resident = 0
        self.num_checksum_failures = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    contains = __contains__

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._entries)

    def store(
        self, block_hash: BlockHash, payload: bytearray, checksum: int, lineage: BlockLineage | None = None
    ) -> list[PushedOut]:
        """Insert (most recently used). Returns: the LRU entries pushed out to stay within capacity, as
        (hash, payload, checksum) for the next tier."""
        if len(payload) > self.capacity_bytes:
            return [(block_hash, payload, checksum)]
        pushed_out: list[PushedOut] = []
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

    def read(self, block_hash: BlockHash) -> bytearray | None:
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

    def take(self, block_hash: BlockHash) -> bytearray | None:
        """Remove and return a block's payload if present and intact (the caller owns it now); a corrupt one is
        dropped, zeroed and counted."""
        with self._lock:
            entry = self._entries.pop(block_hash, None)
            if entry is None:
                return None
            self.bytes_resident -= len(entry[0])
        payload, checksum = entry
        if not verify_block(checksum, payload):
            zero(payload)
            with self._lock:
                self.num_checksum_failures += 1
            return None
        return payload

    def discard(self, hashes) -> int:
        """Forget these blocks (their payloads zeroed); returns how many were here."""
        removed = 0
        with self._lock:
            for block_hash in hashes:
                entry = self._entries.pop(block_hash, None)
                if entry is not None:
                    self.bytes_resident -= len(entry[0])
                    zero(entry[0])
                    removed += 1
        return removed

    def clear(self) -> int:
        """Forget every block (payloads zeroed); returns how many there were."""
        with self._lock:
            return self._clear_locked()

    def _clear_locked(self) -> int:
        removed = len(self._entries)
        for payload, _ in self._entries.values():
            zero(payload)
        self._entries.clear()
        self.bytes_resident = 0
        return removed

    def sync(self) -> None:
        """Nothing to make durable: DRAM does not outlive the process."""

    def wipe(self) -> int:
        """Zero every payload's bytes and forget them (erasure); returns the bytes that were resident."""
        with self._lock:
            resident = self.bytes_resident
            self._clear_locked()
        return resident

    def check_invariants(self) -> None:
        with self._lock:
            assert self.bytes_resident == sum(len(p) for p, _ in self._entries.values()) <= self.capacity_bytes


class Lineage:
    """hash -> (parent hash, tokens) of lower-tier blocks, with the inverse parent -> child hashes.

    Entries may outlive their block in every tier (pruned lazily by `prune`), which is harmless: walks through them
    only find more blocks to forget. `descendants` is iterative (chains may be 100,000 blocks deep).
    """

    def __init__(self):
        self._of: dict[BlockHash, BlockLineage] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._of

    def get(self, block_hash: BlockHash):
        return self._of.get(block_hash)

    def __getitem__(self, block_hash: BlockHash):
        return self._of[block_hash]

    def items(self):
        return self._of.items()

    def add(self, block_hash: BlockHash, parent: BlockHash, tokens) -> None:
        block_hash, parent = BlockHash(bytes(block_hash)), BlockHash(bytes(parent))
        previous = self._of.get(block_hash)
        if previous is not None and previous[0] != parent:
            self._unlink(block_hash, previous[0])
        self._of[block_hash] = (parent, np.array(tokens, dtype=np.int32))
        self._children.setdefault(parent, set()).add(block_hash)

    def remove(self, block_hash: BlockHash) -> None:
        entry = self._of.pop(block_hash, None)
        if entry is not None:
            self._unlink(block_hash, entry[0])

    def _unlink(self, block_hash: BlockHash, parent: BlockHash) -> None:
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[parent]

    def descendants(self, roots) -> list[BlockHash]:
        """Every hash chained under `roots` (the roots themselves included when known here), depth first."""
        out: list[BlockHash] = []
        seen: set[BlockHash] = set()
        stack = [BlockHash(bytes(r)) for r in roots]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            out.append(current)
            stack.extend(self._children.get(current, ()))
        return out

    def clear(self) -> None:
        self._of.clear()
        self._children.clear()

    def prune(self, present) -> None:
        for block_hash in [h for h in self._of if not present(h)]:
            self.remove(block_hash)


class LowerTiers:
    """The tiers below one cache's device pool, in order: DRAM (capacity may be 0), then an optional SsdStore.

    Every method is callable under the cache lock except `sync`, `wipe` and `close` (they may do SSD I/O).
    """

    def __init__(self, dram_bytes: int, ssd=None, network=None):
        self.dram = DramTier(dram_bytes)
        self.ssd = ssd
        self.network = network  # a NetworkTier, or None
        self.moved: dict[tuple[str, str], int] = {}  # (op "put"/"get", tier) -> payload bytes, for /metrics
        self.lineage = Lineage()
        if ssd is not None:
            for block_hash, (parent, tokens) in ssd.lineages().items():  # durable lineage: a warm restart's
                self.lineage.add(block_hash, parent, tokens)

    @property
    def tiers(self) -> list[Tier]:
        return [self.dram] + [tier for tier in (self.ssd, self.network) if tier is not None]

    @property
    def writes_through(self) -> bool:
        """Whether a put's full blocks go to the network store before the put is acknowledged."""
        return self.network is not None and self.network.write_through

    def demote(self, block_hash: BlockHash, payload: bytearray, lineage: BlockLineage) -> None:
        """Keep an evicted full block: DRAM when it fits, its overflow (or the block itself) to SSD, else drop.
        Its lineage (parent hash, tokens) is recorded first, so a block in a tier always has it."""
        self.lineage.add(block_hash, lineage[0], lineage[1])
        if len(self.lineage) > 2 * self._num_blocks() + 1024:
            self.lineage.prune(self.has)
        checksum = block_checksum(payload)
        self.to_network(block_hash, payload, checksum, lineage)
        if len(payload) <= self.dram.capacity_bytes:  # else DramTier.store hands it straight on to SSD
            self._count("put", "dram", len(payload))
        for pushed in self.dram.store(block_hash, payload, checksum):
            self._to_ssd(*pushed)

    def to_network(
        self, block_hash: BlockHash, payload, checksum: int, lineage: BlockLineage, *, owned: bool = False
    ) -> None:
        """Queue a block for the network tier unless it holds it: a copy (the caller keeps `payload`), or with
        `owned` the payload itself (the tier owns it then: zeroed once sealed, or here when not queued)."""
        network = self.network
        if network is None or network.contains(block_hash) or not network.healthy:
            if network is not None and not network.contains(block_hash):
                network.num_dropped_writes += 1  # the store is down: the block stays in the node's own tiers only
            if owned:
                zero(payload)
            return
        if block_hash not in self.lineage:  # a write-through block: the device keeps it, the store gets a copy
            self.lineage.add(block_hash, lineage[0], lineage[1])
        network.store(block_hash, payload if owned else bytearray(payload), checksum, lineage)
        self._count("put", "network", len(payload))

    def probe(self, hashes: Sequence[BlockHash]) -> int:
        """Without the cache lock: let the network tier learn which of `hashes` (held by no lower tier) the store
        holds, so `has`/`count_run` under the lock see them. Returns how many it found."""
        if self.network is None:
            return 0
        return self.network.probe([h for h in hashes if not self.has(h)])

    def write_through(self, block_hash: BlockHash, payload: bytearray, lineage: BlockLineage) -> None:
        """Queue a block that stays on the device for the SSD too (inclusive), with its lineage."""
        self.lineage.add(block_hash, lineage[0], lineage[1])
        self._to_ssd(block_hash, payload, block_checksum(payload))

    def _to_ssd(self, block_hash: BlockHash, payload: bytearray, checksum: int) -> None:
        lineage = self.lineage.get(block_hash)
        if self.ssd is None or lineage is None:
            zero(payload)  # dropped: no tier keeps it
            return
        self.ssd.store(block_hash, payload, checksum, lineage)
        self._count("put", "ssd", len(payload))

    def _count(self, op: str, tier: str, nbytes: int) -> None:
        self.moved[(op, tier)] = self.moved.get((op, tier), 0) + nbytes

    def _num_blocks(self) -> int:
        return sum(len(tier) for tier in self.tiers)

    def present_lineage(self) -> dict[BlockHash, BlockLineage]:
        """Lineage of the blocks some tier holds now (entries of blocks gone from every tier are pruned)."""
        self.lineage.prune(self.has)
        return dict(self.lineage.items())

    def held_by_medium(self) -> dict[str, dict[BlockHash, BlockLineage]]:
        """Tier name ("dram", "ssd", "network") -> {hash: lineage} of the blocks it holds that have lineage (no I/O:
        callable under the cache lock; the cache's block events announce these, block_events.announce_lower)."""
        held = {}
        for name, tier in self._named().items():
            if tier is not None:
                known = ((h, self.lineage.get(h)) for h in set(tier.hashes()))
                held[name] = {h: lineage for h, lineage in known if lineage is not None}
        return held

    def peek(self, block_hash: BlockHash) -> bytearray | None:
        """A verified copy of a block's payload read straight from DRAM or SSD: nothing is promoted or moved."""
        for tier in self.tiers:
            payload = tier.read(block_hash)
            if payload is not None:
                return payload
        return None

    def has(self, block_hash: BlockHash) -> bool:
        return any(tier.contains(block_hash) for tier in self.tiers)

    def count_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes are held by some lower tier (no verification: a pure query)."""
        count = 0
        for block_hash in hashes:
            if not self.has(block_hash):
                break
            count += 1
        return count

    def fetch_run(self, hashes: Sequence[BlockHash]) -> list[bytearray]:
        """Verified payloads of the leading run of `hashes` found in lower tiers (DRAM entries are taken out: the
        caller owns every payload returned and zeroes it when done). A stretch the network tier alone holds is
        fetched in one batched transfer."""
        payloads: list[bytearray] = []
        while len(payloads) < len(hashes):
            block_hash = hashes[len(payloads)]
            payload, tier = self.dram.take(block_hash), "dram"
            if payload is None and self.ssd is not None:
                payload, tier = self.ssd.read(block_hash), "ssd"
            if payload is None and self.network is not None:
                stretch = self._network_stretch(hashes, len(payloads))
                fetched = self._from_network(stretch)
                payloads.extend(fetched)
                if not stretch or len(fetched) < len(stretch):
                    break
                continue
            if payload is None:
                break
            self._count("get", tier, len(payload))
            payloads.append(payload)
        return payloads

    def _network_stretch(self, hashes: Sequence[BlockHash], start: int) -> list[BlockHash]:
        """hashes[start:] as far as the network tier holds them and no node-local tier does (at most a batch)."""
        stretch = []
        for block_hash in hashes[start : start + NETWORK_BATCH_BLOCKS]:
            local = block_hash in self.dram or (self.ssd is not None and self.ssd.contains(block_hash))
            if local or not self.network.contains(block_hash):
                break
            stretch.append(block_hash)
        return stretch

    def _from_network(self, hashes: Sequence[BlockHash]) -> list[bytearray]:
        """The leading verified payloads of `hashes` from the network tier (those after the first miss are zeroed);
        their lineage (sealed in the objects) joins the index, so a block another node stored can be forgotten with
        its prefix here."""
        payloads: list[bytearray] = []
        missed = False
        for block_hash, fetched in zip(hashes, self.network.fetch_many(hashes) if hashes else []):
            missed = missed or fetched is None
            if fetched is None or missed:
                if fetched is not None:
                    zero(fetched[0])
                continue
            payload, lineage = fetched
            if lineage is not None and block_hash not in self.lineage:
                self.lineage.add(block_hash, lineage[0], lineage[1])
            self._count("get", "network", len(payload))
            payloads.append(payload)
        return payloads

    def discard_subtrees(self, roots) -> list[BlockHash]:
        """Forget `roots` and every block chained under them from every tier (in memory at once; `sync` makes it
        durable); returns the hashes some tier held."""
        hashes = self.lineage.descendants(roots)
        removed = [h for h in hashes if self.has(h)]
        for tier in self.tiers:
            tier.discard(hashes)
        for block_hash in hashes:
            self.lineage.remove(block_hash)
        return removed

    def clear(self) -> set[BlockHash]:
        """Forget every block of every tier (in memory; `sync` makes it durable); returns the hashes removed."""
        removed = {h for tier in self.tiers for h in tier.hashes()}
        for tier in self.tiers:
            tier.clear()
        self.lineage.clear()
        return removed

    def sync(self) -> None:
        """Make discards durable (SSD index commit): never under the cache lock."""
        for tier in self.tiers:
            tier.sync()

    def resident_bytes(self) -> dict[str, int]:
        return {name: tier.bytes_resident if tier is not None else 0 for name, tier in self._named().items()}

    def _named(self) -> dict:
        return {"dram": self.dram, "ssd": self.ssd, "network": self.network}

    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Payload bytes moved since the tiers opened: ("put", tier) stored into DRAM or SSD, ("get", tier) fetched
        back to the device."""
        return dict(self.moved)

    def checksum_failures(self) -> dict[str, int]:
        return {name: tier.num_checksum_failures if tier is not None else 0 for name, tier in self._named().items()}

    def wipe(self, *, keep_network: bool = False) -> int:
        """Erasure: zero DRAM, delete the SSD directory, remove the cache's network objects (unless `keep_network`:
        then this node only lets go of them); returns the bytes that were resident in the tiers wiped."""
        keep = self.network if keep_network else None
        if keep is not None:
            keep.close()
        resident = sum(tier.wipe() for tier in self.tiers if tier is not keep)
        self.lineage.clear()
        return resident

    def check_invariants(self) -> None:
        for tier in self.tiers:
            tier.check_invariants()

    def close(self) -> None:
        if self.ssd is not None:
            self.ssd.close()
        if self.network is not None:
            self.network.close()


NETWORK_BATCH_BLOCKS = 64  # blocks fetched from the network store in one batched transfer, at most


# ---- setting tiers up for a hosted cache (the registry calls this) --------------------------------------------------
def open_tiers(
    ssd_root: str,
    cache_id: str,
    tenant_id: str,
    capacity: dict,
    block_bytes: int,
    ssd_key: bytes | None,
    *,
    network_store=None,
    network_write_through: bool = False,
) -> LowerTiers | None:
    """The lower tiers a capacity asks for (None when it asks for none that can hold a block). The SSD and network
    tiers need the cache's data key (`ssd_key`); opening an existing SSD directory rescans it (warm restart). The
    network tier needs this node's store client (a GuardedStore; None: the node has no network store, and the
    tier is absent)."""
    from gpu_node.tiers.ssd_store import SsdStore  # cryptography: only nodes with an SSD tier load it

    dram_bytes = int(capacity.get("dram", 0)) if int(capacity.get("dram", 0)) >= block_bytes else 0
    ssd_bytes = int(capacity.get("ssd", 0))
    network_bytes = int(capacity.get("network", 0))
    store = network = None
    if ssd_key is not None and ssd_bytes >= block_bytes:
        directory = cache_dirs.cache_directory(ssd_root, cache_id)
        store = SsdStore(directory, ssd_key, ssd_bytes)
        cache_dirs.write_owner(directory, tenant_id)
    if ssd_key is not None and network_store is not None and network_bytes >= block_bytes:
        from gpu_node.tiers.network_tier import NetworkTier

        network = NetworkTier(network_store, ssd_key, network_bytes, write_through=network_write_through)
    if not dram_bytes and store is None and network is None:
        return None
    return LowerTiers(dram_bytes, store, network)
