"""The KCaaS side of the vLLM tier (no vLLM import): vLLM's offload chunks kept in a KCaaS cache as named pages.

vLLM's offloading tiers see a chunk only by its OffloadKey (bytes) and its slot in the CPU primary tier (a row of
bytes). The data plane keys KV by token prefix, so each chunk is its own one-page sequence whose token ids stand for
the key (`kcaas.connectors.named_pages.page_tokens`):

    exists(keys)              lookup_batch: a chunk is there when all of its page's tokens are cached
    store(keys, slots)        put_batch of the slots' bytes, viewed in place as the cache's KV (no copy)
    load(keys, slots)         get_batch straight into the slots (`outs=`, no copy); returns how many leading keys
                              arrived whole (a short or failed answer: the rest are failures, never partial KV)

A page holds the chunk's bytes exactly as vLLM's primary tier lays them out (its host layout, not KCaaS's canonical
[layers, 2, tokens, heads, head_dim] order): the namespace names that layout, so chunks of another layout, chunk
size or parallelism never meet, and the cache's identity (fingerprint, dtype, sizes) is checked at start. Calls
block: the tier runs them on its own threads, each with its own client (one request at a time per client).
"""

from __future__ import annotations

from dataclasses import dataclass

from kcaas.connectors.named_pages import page_tokens
from kcaas.connectors.vllm_session import CacheSession, ConnectorSetupError
from kcaas.dataplane_transport import DataPlaneError

__all__ = ["ChunkGeometry", "ChunkStore", "TRANSFER_ERRORS"]

TRANSFER_ERRORS = (DataPlaneError, OSError, ValueError)  # what a node, its network or a short answer can raise


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    """One offload chunk: its tokens, the bytes of KV it holds (a slot may be padded beyond) and its host layout."""

    tokens_per_chunk: int
    payload_bytes: int
    layout: str  # vLLM's host layout of a chunk (layout name, world size, ...): part of every page's namespace

    @property
    def namespace(self) -> str:
        return f"vllm-offload/{self.layout}/{self.tokens_per_chunk}t/{self.payload_bytes}B"


class ChunkStore:
    """Named pages of one cache for one chunk geometry, over one data-plane client (calls block; not thread-safe:
    give each thread its own store from `for_thread`)."""

    def __init__(self, session: CacheSession, geometry: ChunkGeometry, slots, *, timeout: float):
        """`slots`: a writable 2-D uint8 array (numpy) over the primary tier, one row per chunk slot."""
        self._session, self.geometry, self._slots, self._timeout = session, geometry, slots, timeout
        spec = session.spec
        chunk_bytes = spec.kv_bytes_per_token * geometry.tokens_per_chunk
        if chunk_bytes != geometry.payload_bytes:
            raise ConnectorSetupError(
                f"cache {session.config.cache!r} holds {spec.kv_bytes_per_token} bytes of KV a token, so a "
                f"{geometry.tokens_per_chunk}-token chunk would be {chunk_bytes} bytes, but vLLM's chunks hold "
                f"{geometry.payload_bytes} (attach the cache with this model's spec)"
            )
        if spec.storage_dtype != spec.kv_dtype:
            raise ConnectorSetupError(
                f"cache {session.config.cache!r} stores {spec.storage_dtype}: a chunk's bytes are kept exactly, so the"
                f" tier needs a cache that stores {spec.kv_dtype} (attach one without --storage-dtype)"
            )
        if slots.shape[1] < geometry.payload_bytes:
            raise ConnectorSetupError(f"vLLM's primary slots ({slots.shape[1]} bytes) are smaller than a chunk")
        self._dp = session.data_plane(timeout=timeout)
        self._tokens: dict[bytes, memoryview] = {}

    def for_thread(self) -> ChunkStore:
        """Another store on the same cache and slots, with its own connection."""
        return ChunkStore(self._session, self.geometry, self._slots, timeout=self._timeout)

    def tokens(self, key: bytes) -> memoryview:
        """The page token ids of chunk `key` (memoized: keys recur across lookups, stores and loads)."""
        ids = self._tokens.get(key)
        if ids is None:
            ids = page_tokens(self.geometry.namespace, key, self.geometry.tokens_per_chunk)
            if len(self._tokens) > 65536:
                self._tokens.clear()
            self._tokens[key] = ids
        return ids

    def exists(self, keys) -> list[bool]:
        """Whether each chunk is cached whole. Raises TRANSFER_ERRORS (the caller treats it as a miss)."""
        n = self.geometry.tokens_per_chunk
        return [cached == n for cached in self._dp.lookup_batch([self.tokens(k) for k in keys])]

    def store(self, keys, slots) -> bool:
        """Put each chunk `keys[i]` from primary slot `slots[i]`; True when every one is cached whole.
        Raises TRANSFER_ERRORS."""
        items = [(self.tokens(k), self._kv(int(s))) for k, s in zip(keys, slots, strict=True)]
        if not items:
            return True
        n = self.geometry.tokens_per_chunk
        return all(r["num_cached"] == n for r in self._dp.put_batch(items))

    def load(self, keys, slots) -> int:
        """Get each chunk into its primary slot; the number of leading keys that arrived whole (a slot past it may
        hold part of an answer: the caller must not use it). Never raises: a failure loads nothing more."""
        keys, slots = list(keys), [int(s) for s in slots]
        if not keys:
            return 0
        n = self.geometry.tokens_per_chunk
        try:
            answers = self._dp.get_batch([self.tokens(k) for k in keys], outs=[self._kv(s) for s in slots])
        except TRANSFER_ERRORS:
            return 0
        whole = 0
        for cached, _ in answers:
            if cached != n:
                break
            whole += 1
        return whole

    def close(self) -> None:
        self._dp.close()

    def _kv(self, slot: int):
        """Slot `slot`'s chunk bytes as the cache's KV tensor [layers, 2, tokens, heads, head_dim], in place."""
        import torch

        spec = self._session.spec
        raw = torch.from_numpy(self._slots[slot, : self.geometry.payload_bytes])
        shape = (spec.num_layers, 2, self.geometry.tokens_per_chunk, spec.num_kv_heads, spec.head_dim)
        return raw.view(getattr(torch, spec.kv_dtype)).view(shape)
