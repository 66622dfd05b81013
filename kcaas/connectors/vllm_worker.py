"""The vLLM connector's worker side (no vLLM import): loads into vLLM's blocks before or during a forward, saves out
of them during and after it, counts what it did. kcaas/connectors/vllm.py calls it; the plan (which tokens, which
blocks) comes from the scheduler side as `Load`s and `Save`s.

Invariants:
  * a load fills the slots of its tokens (whole cache blocks; the last may end inside a vLLM block) with KV the
    node sent for exactly those tokens; every promised block it could not fill is reported once
    (`take_failed_blocks`) so vLLM recomputes it — never left as garbage;
  * a save's KV is copied out of vLLM's pool layer by layer during the forward, and all of it before the step's
    wait_for_save returns (vLLM may reuse the blocks then: kcaas/connectors/vllm_saves.py); the PUT happens in
    wait_for_save (sync) or on the saver thread (async), and its failure is a later miss, never an engine error;
  * no exception of the node or the network reaches vLLM from a load or a save.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from kcaas.connectors.io_threads import io_cpus
from kcaas.connectors.vllm_blocks import (
    BACKEND_HINTS,
    BACKEND_LAYOUTS,
    CacheWrite,
    LayoutProbeError,
    PagedLayout,
    scatter,
)
from kcaas.connectors.vllm_loads import LayerwiseLoads, Load
from kcaas.connectors.vllm_saves import SaveQueue, StagedSaves
from kcaas.connectors.vllm_session import CacheSession, ConnectorConfig, ConnectorSetupError, EngineLayout
from kcaas.dataplane import DataPlaneClient, DataPlaneError

logger = logging.getLogger("kcaas.connectors.vllm")


@dataclass(frozen=True)
class Save:
    """PUT the KV of `tokens` (whole cache blocks; `block_ids`: the vLLM blocks holding them, the last maybe only in
    part), the cache holding tokens[:start] already."""

    tokens: np.ndarray
    start: int
    block_ids: list[int]


def _layer_order(name: str) -> tuple:
    return tuple(int(n) for n in re.findall(r"\d+", name)), name


class ConnectorWorker:
    def __init__(self, session: CacheSession, config: ConnectorConfig, layout: EngineLayout):
        self._session, self._config, self._layout = session, config, layout
        self._loader = session.data_plane(timeout=config.io_timeout_s) if config.reads else None
        self._stats: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._failed: set[int] = set()
        self._layers: list[torch.Tensor] = []
        self._paged: PagedLayout | None = None
        cpus = io_cpus(config.io_cpus)
        logger.info("KCaaS connector: I/O threads on CPUs %s", sorted(cpus) if cpus else "as started (not rebound)")
        self._saver = (
            SaveQueue(self.put, config.save_queue_bytes, lambda: self.count(saves_dropped=1), cpus)
            if config.writes and config.save == "async"
            else None
        )
        self._staged = StagedSaves(self._pool, cpus) if config.writes else None
        self._put_client: DataPlaneClient | None = None
        self._layer_index: dict[str, int] = {}
        self._layerwise = (
            LayerwiseLoads(
                self._reader, self._pool, session.spec.kv_bytes_per_token, config.io_timeout_s, self.count, cpus
            )
            if config.reads and config.load == "layerwise"
            else None
        )  # fmt: skip

    # ---- set-up -------------------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], backends: set[str], write: CacheWrite | None = None) -> None:
        """vLLM's per-layer paged tensors, the names of the attention backends that read them, and the backend's
        own cache write where it can run here (then the block layout is probed from it, never assumed).
        Raises ConnectorSetupError for an unknown backend, a write the layout probe cannot map, or tensors of
        another layout than the cache's."""
        kinds = {BACKEND_LAYOUTS[name] for name in backends if name in BACKEND_LAYOUTS}
        if len(kinds) != 1 or not backends <= BACKEND_LAYOUTS.keys():
            hints = "".join(f"; {BACKEND_HINTS[name]}" for name in sorted(backends) if name in BACKEND_HINTS)
            raise ConnectorSetupError(
                f"attention backend {sorted(backends)} is not supported (known: {sorted(BACKEND_LAYOUTS)}){hints}"
            )
        names = sorted(kv_caches, key=_layer_order)
        layers = [kv_caches[name] for name in names]
        kind = kinds.pop()
        try:
            paged = PagedLayout.probed(kind, layers[0], write) if write else PagedLayout.of(kind, layers[0])
        except LayoutProbeError as exc:
            raise ConnectorSetupError(f"cannot map vLLM's paged KV: {exc}") from exc
        spec, layout = self._session.spec, self._layout
        found = (len(layers), paged.num_kv_heads, paged.head_dim, paged.block_size)
        wanted = (spec.num_layers, spec.num_kv_heads, spec.head_dim, layout.block_size)
        if found != wanted:
            raise ConnectorSetupError(
                f"vLLM's KV tensors are (layers, kv heads, head size, block size) {found}, the cache's layout {wanted}"
            )
        self._layers, self._paged = layers, paged
        self._layer_index = {name: index for index, name in enumerate(names)}

    def _pool(self) -> tuple[list[torch.Tensor], PagedLayout]:
        """vLLM's paged tensors and their layout. Raises ConnectorSetupError before register()."""
        if self._paged is None:
            raise ConnectorSetupError("vLLM's KV tensors are not registered yet (register_kv_caches comes first)")
        return self._layers, self._paged

    def _reader(self) -> DataPlaneClient:
        """The loads' client. Raises ConnectorSetupError on a connector whose role does not read."""
        if self._loader is None:
            raise ConnectorSetupError(f"a load planned for a connector whose role ({self._config.role}) does not read")
        return self._loader

    # ---- loads --------------------------------------------------------------------------------------------------
    def load(self, loads: list[Load]) -> None:
        """The step's loads: begun on the loader thread, layer by layer (`load: "layerwise"`, the default), or
        done here, every layer before the forward (`load: "sync"`)."""
        if self._layerwise is not None:
            self.finish_loads()  # a step vLLM ended without wait_for_save: its loads settled before buffers are reused
            self._layerwise.start(loads)
            return
        for load in loads:
            self._load_one(load)

    def wait_layer(self, layer_name: str) -> None:
        """Before the attention of `layer_name`: its layer of the step's loads is in vLLM's blocks."""
        if self._layerwise is not None and layer_name in self._layer_index:
            self._layerwise.wait_layer(self._layer_index[layer_name])

    def finish_loads(self) -> None:
        """The step's forward is over: the loads joined, what they did not fill reported (take_failed_blocks)."""
        if self._layerwise is not None:
            failed = self._layerwise.finish()
            with self._lock:
                self._failed.update(failed)

    def _load_one(self, load: Load) -> None:
        started = time.perf_counter()
        try:
            end, kv = self._reader().get(load.tokens, start=load.start)
        except Exception as exc:  # noqa: BLE001 - the node or the network: those blocks are recomputed
            logger.warning(
                "KCaaS load of %d tokens failed (%s): vLLM recomputes them", len(load.tokens) - load.start, exc
            )
            end, kv = load.start, None
        filled = load.filled(end)
        if filled:
            scatter(*self._pool(), load.blocks_holding(filled), kv[:, :, :filled])
        missed = load.missed(filled)
        with self._lock:
            self._failed.update(missed)
            self._count(
                loaded_tokens=filled,
                loaded_bytes=filled * self._session.spec.kv_bytes_per_token,
                load_seconds=time.perf_counter() - started,
                load_failures=1 if missed else 0,
                failed_tokens=load.num_tokens - filled,
            )

    def take_failed_blocks(self) -> set[int]:
        self.finish_loads()
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    # ---- saves --------------------------------------------------------------------------------------------------
    def layer_saved(self, layer_name: str, saves: list[Save]) -> None:
        """After the attention of `layer_name` (vLLM's save_kv_layer) in the step whose saves are `saves`: its KV
        for the step is written."""
        if self._staged is not None and layer_name in self._layer_index:
            self._staged.layer_written(self._layer_index[layer_name], saves)

    def finish_saves(self, saves: list[Save]) -> None:
        """The step's forward is over (vLLM's wait_for_save): its saves' copies joined (what vLLM did not report is
        copied now), then PUT here (sync) or handed to the saver thread (async)."""
        if self._staged is None:
            return
        waited = time.perf_counter()
        staged = self._staged.finish(saves)
        if staged:
            self.count(save_wait_seconds=time.perf_counter() - waited, save_layers_copied_late=self._staged.copied_late)
        for save, kv in staged:
            if self._saver is not None:
                self._saver.submit(save, kv)
            else:
                self.put(save, kv)

    def put(self, save: Save, kv: torch.Tensor) -> None:
        """One save's PUT (only the tokens the cache lacks cross the wire; all of them if it lost the rest)."""
        try:
            if self._put_client is None:
                self._put_client = self._session.data_plane(timeout=self._config.io_timeout_s)
            try:
                self._put_client.put(save.tokens, kv[:, :, save.start :], start=save.start)
            except DataPlaneError as exc:
                if exc.code != "prefix_not_cached":
                    raise
                self._put_client.put(save.tokens, kv)
        except Exception as exc:  # noqa: BLE001 - a save that failed is a later miss, never an engine error
            logger.warning("KCaaS save of %d tokens failed: %s", len(save.tokens), exc)
            self.count(save_failures=1)
            return
        sent = len(save.tokens) - save.start
        self.count(saved_tokens=sent, saved_bytes=sent * self._session.spec.kv_bytes_per_token)

    # ---- stats and shutdown -------------------------------------------------------------------------------------
    def _count(self, **values: float) -> None:
        for name, value in values.items():
            self._stats[name] += value

    def count(self, **values: float) -> None:
        with self._lock:
            self._count(**values)

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            stats, self._stats = dict(self._stats), defaultdict(float)
        return stats

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close(self._config.io_timeout_s)
        for client in (self._loader, self._put_client):
            if client is not None:
                client.close()
