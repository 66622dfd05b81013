"""SGLang HiCache pages in a KCaaS cache, without SGLang or torch imported: the backend's configuration (from
`--hicache-storage-backend-extra-config`), the namespace its pages are named in, and the page I/O over the data plane.

- `HiCacheConfig.from_extra(extra)`: kcaas_url, cache, ca_file, api_key_env, io_timeout_s, model_fingerprint; the
  keys SGLang itself reads there (SGLANG_KEYS: the dynamic backend's, interface_v1, prefetch knobs) are passed over;
- `page_namespace(...)`: which engine pages share names: MLA pages once for every TP rank, MHA pages per TP rank,
  always per pipeline stage and attention-CP rank and per host-memory byte order (a page's bytes are SGLang's);
- `PageStore`: exists / put / get of whole pages, each page its own one-page sequence of named-page token ids
  (kcaas.connectors.named_pages). A node that is down, slow or refusing makes a miss or a False, never an exception
  into SGLang's storage threads and never a wait beyond io_timeout_s per request.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kcaas.connectors.named_pages import page_tokens
from kcaas.connectors.vllm_session import ConnectorSetupError
from kcaas.dataplane import DataPlaneError

logger = logging.getLogger(__name__)

# keys SGLang itself reads in the same extra config (the dynamic backend's, the v1 switch, its prefetch knobs)
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
KNOWN_KEYS = frozenset({"kcaas_url", "cache", "api_key_env", "ca_file", "io_timeout_s", "model_fingerprint"})
NAMESPACE = "sglang"  # named_pages' namespace of every SGLang page (the rest of the name: page_namespace)
IO_ERRORS = (DataPlaneError, OSError, ValueError)  # what a page I/O turns into a miss (a timeout is an OSError)


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """The backend's settings; the API key itself stays in the environment variable `api_key_env` names."""

    url: str
    cache: str
    api_key_env: str = "KCAAS_API_KEY"
    ca_file: str | None = None
    io_timeout_s: float = 5.0  # one data-plane request: a hung node costs at most this, then a miss
    model_fingerprint: str | None = None  # the cache's fingerprint (default: SGLang's model name)

    @classmethod
    def from_extra(cls, extra: dict | None, environ=os.environ) -> HiCacheConfig:
        """The settings in SGLang's extra config (KCAAS_URL when kcaas_url is absent).

        Raises: ConnectorSetupError naming an unknown key, a missing URL or cache, or a value of the wrong type."""
        extra = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ConnectorSetupError(f"unknown hicache extra config keys {unknown} (known: {sorted(KNOWN_KEYS)})")
        url = extra.get("kcaas_url") or environ.get("KCAAS_URL")
        if not url:
            raise ConnectorSetupError("no control-plane URL: set the extra config's kcaas_url or KCAAS_URL")
        if not extra.get("cache"):
            raise ConnectorSetupError("the extra config's cache (the cache's id or name) is required")
        try:
            return cls(
                url=str(url),
                cache=str(extra["cache"]),
                api_key_env=str(extra.get("api_key_env") or "KCAAS_API_KEY"),
                ca_file=extra.get("ca_file"),
                io_timeout_s=float(extra.get("io_timeout_s", 5.0)),
                model_fingerprint=extra.get("model_fingerprint"),
            )
        except (TypeError, ValueError) as exc:
            raise ConnectorSetupError(f"an extra config value has the wrong type: {exc}") from None


def page_namespace(
    *, layout: str, is_mla: bool, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, cp_rank: int, cp_size: int
) -> str:
    """The part of a page's name beyond its hash: what makes two engines' pages interchangeable.

    MLA KV is the same on every TP rank: one name for all of them (one copy). MHA KV is sharded by head: each TP rank
    names its own. Pipeline stages and attention-CP ranks hold different layers or slices: always their own. The
    host layout is in the name because a page is stored in SGLang's host byte order for that layout."""
    parts = [layout, "mla" if is_mla else f"tp{tp_rank}of{tp_size}"]
    if pp_size > 1:
        parts.append(f"pp{pp_rank}of{pp_size}")
    if cp_size > 1:
        parts.append(f"cp{cp_rank}of{cp_size}")
    return "/".join(parts)


class PageStore:
    """Whole pages of `page_size` tokens of a cache, named by (namespace, key). Lookups, reads and writes each use
    their own data-plane client (SGLang asks what exists, prefetches and backs up on three threads of its own; a
    client serializes its calls, so an exists never waits behind a long get)."""

    def __init__(self, lookups, reads, writes, namespace: str, page_size: int):
        self._lookups, self._reads, self._writes = lookups, reads, writes
        self.namespace, self.page_size = namespace, page_size

    def tokens(self, key: str):
        """The page's token ids (int32 memoryview) in this store's namespace."""
        return page_tokens(NAMESPACE, f"{self.namespace}/{key}", self.page_size)

    def exists_prefix(self, keys: list[str]) -> int:
        """How many leading pages of `keys` the cache holds whole (0 on any error)."""
        if not keys:
            return 0
        try:
            held = self._lookups.lookup_batch([self.tokens(k) for k in keys])
        except IO_ERRORS as exc:
            logger.warning("KCaaS HiCache lookup of %d pages failed (a miss): %s", len(keys), exc)
            return 0
        return next((i for i, n in enumerate(held) if n < self.page_size), len(keys))

    def put(self, keys: list[str], pages: list) -> list[bool]:
        """Store each page (a [layers, 2, page_size, heads, dim] tensor in the cache's dtype); True where the cache
        holds it whole afterwards (all False on any error)."""
        if not keys:
            return []
        try:
            answers = self._writes.put_batch([(self.tokens(k), page) for k, page in zip(keys, pages)])
        except IO_ERRORS as exc:
            logger.warning("KCaaS HiCache put of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [a["num_cached"] >= self.page_size and not a["out_of_space"] for a in answers]

    def get(self, keys: list[str], outs: list) -> list[bool]:
        """Read each page into outs[i] (a contiguous CPU tensor in the cache's dtype with room for a page); True where
        the whole page arrived (all False on any error: an `out` may then hold part of a page, never reported)."""
        if not keys:
            return []
        try:
            answers = self._reads.get_batch([self.tokens(k) for k in keys], outs=outs)
        except IO_ERRORS as exc:
            logger.warning("KCaaS HiCache get of %d pages failed (a miss): %s", len(keys), exc)
            return [False] * len(keys)
        return [n >= self.page_size for n, _ in answers]

    def close(self) -> None:
        for client in (self._lookups, self._reads, self._writes):
            client.close()
