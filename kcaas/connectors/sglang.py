"""KCaaS as SGLang's HiCache storage backend (SGLang's third tier, below GPU memory and its host pool), loaded by SGLang
itself from its extra config (docs/sglang.md):

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kcaas", "module_path": "kcaas.connectors.sglang", "class_name": "KCaaSHiCacheStorage",
        "interface_v1": 1, "kcaas_url": "https://...", "cache": "chat"}'

SGLang's calls, one line each (sglang/srt/mem_cache/hicache_storage.py is the contract):
- register_mem_pool_host(pool): opens the cache (ConnectorSetupError if it cannot be used: SGLang does not start);
- batch_exists(keys) -> the number of leading pages held; exists(key);
- batch_get_v1(keys, host_indices) / batch_set_v1(keys, host_indices) -> one bool per page, straight between the
  host pool's memory and the data plane (SGLang takes this path with "interface_v1": 1);
- batch_get(keys, targets) / batch_set(keys, values), get / set: the same over tensors SGLang hands in;
- clear() (refused: a tenant clears a cache through the control plane), close(), get_stats().
Every page is its own one-page sequence of named-page token ids (kcaas.connectors.sglang_pages): a failure is a miss
or a False, never an exception and never wrong KV. MLA pages have one name for all TP ranks and only SGLang's storage
writer (TP rank 0 of the first DCP group) writes them; MHA pages are per TP rank.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kcaas.connectors.sglang_host import HostPages, engine_layout
from kcaas.connectors.sglang_pages import HiCacheConfig, PageStore, page_namespace
from kcaas.connectors.vllm_session import CacheSession, ConnectorConfig, ConnectorSetupError

logger = logging.getLogger(__name__)

__all__ = ["KCaaSHiCacheStorage"]


class KCaaSHiCacheStorage(HiCacheStorage):
    """One SGLang rank's view of a KCaaS cache (module docstring). Usable once register_mem_pool_host ran."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None, environ=os.environ):
        self.storage_config = storage_config
        self.config = HiCacheConfig.from_extra(storage_config.extra_config, environ)
        self.writer = bool(storage_config.is_storage_writer)
        self._environ = environ
        self.session: CacheSession | None = None
        self.v1 = bool(int((storage_config.extra_config or {}).get("interface_v1", 0)))
        self.store: PageStore | None = None  # the pages of the path SGLang takes (exists answers for it)
        self._stores: dict[str, PageStore] = {}  # "v1": host-pool regions; "flat": SGLang's flat data pages
        self.pages: HostPages | None = None
        self.stats = {"pages_read": 0, "pages_written": 0, "pages_missed": 0, "pages_failed_to_write": 0}

    # ---- set-up -------------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Open the cache for this pool's KV layout: the cache's spec must equal it (page size a multiple of the
        cache's block size). Raises: ConnectorSetupError saying what to change."""
        super().register_mem_pool_host(mem_pool_host)
        if self.session is not None:
            return
        sc = self.storage_config
        fingerprint = self.config.model_fingerprint or sc.model_name or ""
        layout = engine_layout(mem_pool_host, is_mla=sc.is_mla_model, model_fingerprint=fingerprint)
        role = "kv_both" if self.writer else "kv_consumer"  # an MLA rank that never writes gets a read token
        connector = ConnectorConfig(
            url=self.config.url,
            cache=self.config.cache,
            role=role,
            api_key_env=self.config.api_key_env,
            ca_file=self.config.ca_file,
            io_timeout_s=self.config.io_timeout_s,
        )
        self.session = CacheSession(connector, layout, self._environ)
        page_size = int(mem_pool_host.page_size)
        self.pages = HostPages(mem_pool_host, self.session.spec, page_size)
        namespace = page_namespace(
            layout=str(mem_pool_host.layout),
            is_mla=sc.is_mla_model,
            tp_rank=sc.tp_rank,
            tp_size=sc.tp_size,
            pp_rank=sc.pp_rank,
            pp_size=sc.pp_size,
            cp_rank=sc.attn_cp_rank,
            cp_size=sc.attn_cp_size,
        )
        timeout = self.config.io_timeout_s
        lookups, reads, writes = (self.session.data_plane(timeout=timeout, overloaded_retries=2) for _ in range(3))
        # the two paths store a page in different byte orders (regions vs SGLang's flat data page): never one name
        self._stores = {
            path: PageStore(lookups, reads, writes, f"{namespace}/{path}", page_size) for path in ("v1", "flat")
        }
        self.store = self._stores["v1" if self.v1 else "flat"]
        logger.info("KCaaS HiCache storage: cache %s, pages named %s/...", self.session.cache.id, namespace)

    # ---- zero-copy path (interface_v1) --------------------------------------------------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        """The number of leading pages of `keys` the cache holds whole."""
        return self._ready().exists_prefix(list(keys))

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Read each page straight into its host-pool slots (one-region pages in place, others through one staging
        copy); True per page that arrived whole."""
        store, pages = self._ready("v1"), self._ready_pages()
        try:
            regions = pages.regions(host_indices)
        except ValueError as exc:
            logger.warning("KCaaS HiCache get: %s", exc)
            return [False] * len(keys)
        if all(len(views) == 1 for views in regions):
            return self._count(store.get(list(keys), [pages.as_page(v[0]) for v in regions]), read=True)
        staging = pages.staging(len(keys))
        ok = store.get(list(keys), [pages.as_page(row) for row in staging])
        for row, views, good in zip(staging, regions, ok):
            if good:
                pages.scatter(row, views)
        return self._count(ok, read=True)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Store each page from its host-pool slots; True per page the cache holds whole afterwards."""
        if not self.writer:
            return [True] * len(keys)  # MLA: the storage writer rank stores the one copy (SGLang's backup_skip)
        store, pages = self._ready("v1"), self._ready_pages()
        try:
            regions = pages.regions(host_indices)
        except ValueError as exc:
            logger.warning("KCaaS HiCache set: %s", exc)
            return [False] * len(keys)
        return self._count(store.put(list(keys), [pages.page_for_put(v) for v in regions]), read=False)

    # ---- tensor path (SGLang's generic page get/set) ------------------------------------------------------------
    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list:
        """Read each page into target_locations[i] (SGLang's flat data page); that tensor, or None on a miss."""
        if target_locations is None:
            return [None] * len(keys)
        pages = self._ready_pages()
        try:
            outs = [pages.as_page(t) for t in target_locations]
        except (RuntimeError, ValueError) as exc:
            logger.warning("KCaaS HiCache get: targets are not whole contiguous pages: %s", exc)
            return [None] * len(keys)
        ok = self._count(self._ready("flat").get(list(keys), outs), read=True)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Store each value (SGLang's flat data page); True when the cache holds them all whole."""
        if not self.writer:
            return True
        pages = self._ready_pages()
        try:
            tensors = [pages.as_page(v.contiguous()) for v in values]
        except (RuntimeError, ValueError) as exc:
            logger.warning("KCaaS HiCache set: values are not whole pages: %s", exc)
            return False
        return all(self._count(self._ready("flat").put(list(keys), tensors), read=False))

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the rest -----------------------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Refused (False): a cache is cleared by its tenant through the control plane, not by one engine."""
        logger.warning("KCaaS HiCache storage does not clear the cache: detach or delete it through KCaaS")
        return False

    def get_stats(self):
        return dict(self.stats)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()  # the data-plane clients both paths share
        if self.session is not None:
            self.session.close()
        self.store, self.session, self._stores = None, None, {}

    def _ready(self, path: str | None = None) -> PageStore:
        store = self._stores.get(path or ("v1" if self.v1 else "flat"))
        if store is None:
            raise ConnectorSetupError("SGLang called the storage before register_mem_pool_host")
        return store

    def _ready_pages(self) -> HostPages:
        self._ready()
        assert self.pages is not None
        return self.pages

    def _count(self, ok: list[bool], *, read: bool) -> list[bool]:
        hits = sum(ok)
        if read:
            self.stats["pages_read"] += hits
            self.stats["pages_missed"] += len(ok) - hits
        else:
            self.stats["pages_written"] += hits
            self.stats["pages_failed_to_write"] += len(ok) - hits
        return ok
