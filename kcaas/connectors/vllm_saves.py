"""The vLLM connector's saves off the forward's path (no vLLM import): the KV of a step's saves is copied out of
vLLM's blocks layer by layer while the forward runs (`StagedSaves`: vLLM's save_kv_layer, after each layer's
attention, hands the layer to a copier thread), and the PUTs of async saves run on a saver thread (`SaveQueue`).

Invariants:
  * a layer is copied only after vLLM's forward wrote it for this step (save_kv_layer comes after the layer's
    attention, whose KV write precedes it), and every copy of a step is over before `finish` returns: vLLM may
    reuse or overwrite the blocks once the step ends, and nothing reads them after;
  * `finish` returns each save's KV complete in every layer: a layer vLLM never reported (or whose copy failed) is
    copied there, on the caller's thread;
  * at most `limit_bytes` of KV wait in the SaveQueue; a save beyond it is dropped and counted (a later miss).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from kcaas.connectors.io_threads import bind_current_thread
from kcaas.connectors.vllm_blocks import gather

logger = logging.getLogger("kcaas.connectors.vllm")


class StagedSaves:
    """A step's saves, copied out layer by layer. `pool()` gives vLLM's paged layers and their layout; each save
    has `block_ids` (vLLM's blocks holding its tokens) and `tokens`; the copier thread runs on `cpus`
    (kcaas/connectors/io_threads.py; empty: where it is started)."""

    def __init__(self, pool: Callable, cpus: set[int] | None = None):
        self._pool, self._cpus = pool, cpus or set()
        self._saves: list = []
        self._outs: list[torch.Tensor] = []
        self._copied: set[int] = set()
        self.copied_late = 0  # layers the last finish copied itself (vLLM did not report them during the forward)
        self._lock = threading.Lock()
        self._layers: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kcaas-save-copier", daemon=True)
        self._thread.start()

    def _begin(self, saves: list) -> None:
        """The step's saves: their buffers, no layer copied yet (the copier is idle: the last step finished)."""
        layers, paged = self._pool()
        shape = (len(layers), 2, 0, paged.num_kv_heads, paged.head_dim)
        self._saves = saves
        self._outs = [
            torch.empty(shape[:2] + (len(save.block_ids) * paged.block_size,) + shape[3:], dtype=layers[0].dtype)
            for save in saves
        ]
        self._copied = set()

    def layer_written(self, index: int, saves: list) -> None:
        """vLLM's save_kv_layer: layer `index` of the step whose saves are `saves` (the step's own list: the first
        layer reported begins them) is written; the copier thread copies it out."""
        if saves and saves is not self._saves:
            self._begin(saves)
        if self._saves:
            self._layers.put(index)

    def _run(self) -> None:
        bind_current_thread(self._cpus)
        while True:
            item = self._layers.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._copy(item)
            except Exception:  # copied again by finish, on the caller's thread
                logger.exception("KCaaS save: copying layer %d out failed", item)

    def _copy(self, index: int) -> None:
        layers, paged = self._pool()
        with torch.inference_mode():  # the engine's tensors are inference tensors; the mode is per thread
            for save, out in zip(self._saves, self._outs, strict=True):
                gather([layers[index]], paged, save.block_ids, out=out[index : index + 1])
        with self._lock:
            self._copied.add(index)

    def finish(self, saves: list) -> list[tuple[Any, torch.Tensor]]:
        """The step's forward is over (its saves: `saves`): every copy joined; each save with its KV ([layers, 2,
        tokens, ...]), every layer copied (those vLLM did not report, here: `copied_late` counts them)."""
        if saves and saves is not self._saves:
            self._begin(saves)  # no layer was reported in this step
        if not self._saves:
            return []
        drained = threading.Event()
        self._layers.put(drained)
        drained.wait()
        missing = [index for index in range(len(self._pool()[0])) if index not in self._copied]
        for index in missing:
            self._copy(index)
        self.copied_late = len(missing)
        staged = [(save, out[:, :, : len(save.tokens)]) for save, out in zip(self._saves, self._outs, strict=True)]
        self._saves, self._outs = [], []
        return staged


class SaveQueue:
    """Async saves: a thread (on `cpus`) runs `put(save, kv)` in order; at most `limit_bytes` of KV wait (a save
    beyond it is dropped and `dropped()` called)."""

    def __init__(self, put: Callable, limit_bytes: int, dropped: Callable[[], None], cpus: set[int] | None = None):
        self._put, self._limit, self._dropped, self._cpus = put, limit_bytes, dropped, cpus or set()
        self._queue: queue.Queue = queue.Queue()
        self._waiting_bytes = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kcaas-saver", daemon=True)
        self._thread.start()

    def submit(self, save, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self._lock:
            if self._waiting_bytes + size > self._limit:
                self._dropped()
                return
            self._waiting_bytes += size
        self._queue.put((save, kv, size))

    def _run(self) -> None:
        bind_current_thread(self._cpus)
        while (item := self._queue.get()) is not None:
            save, kv, size = item
            try:
                self._put(save, kv)
            finally:
                with self._lock:
                    self._waiting_bytes -= size

    def close(self, timeout_s: float) -> None:
        """Send what is queued (for at most `timeout_s`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)
