"""Layer-pipelined loads for the vLLM connector's worker (no vLLM import): a step's GETs run on a loader thread while
vLLM's forward runs, each answer streamed layer by layer into a staging buffer (DataPlaneClient.get's `progress`)
and each layer scattered into vLLM's blocks by the loader as soon as its bytes are all in. The attention of layer i
waits (`wait_layer`, from vLLM's wait_for_layer_load) only until layer i of every load of the step is there. The
forward of layer i thus overlaps the arrival and the scatter of layers i+1, i+2, ... on the connector's own CPUs
(kcaas/connectors/io_threads.py).

Invariants:
  * a layer of a load is scattered once, in order, and only once the node's bytes for all of its tokens are in the
    staging buffer; it writes only the slots of the load's tokens (vLLM may be writing its own tokens' KV into the
    rest of the last block at the same time);
  * when the step ends (`finish`), every promised token's slot held the node's KV in every layer before the
    forward read that layer, or its block is reported failed (vLLM recomputes it): a load that failed, came back
    short, or had a layer the forward did not wait for, or read before it was there, fails the blocks it did not
    fill in every layer;
  * a staging buffer is reused only after the step that filled it finished (the loader thread joined).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kcaas.connectors.io_threads import bind_current_thread
from kcaas.connectors.vllm_blocks import PagedLayout, scatter

logger = logging.getLogger("kcaas.connectors.vllm")


@dataclass(frozen=True)
class Load:
    """Fill the slots of tokens[start:] with their KV: `block_ids` are the vLLM blocks holding them, in order
    (tokens: the prompt up to the load's end, a whole number of cache blocks; start: vLLM's own hit, a whole number
    of vLLM blocks; the last block may hold fewer of the load's tokens than it has slots)."""

    req_id: str
    tokens: np.ndarray
    start: int
    block_ids: list[int]
    block_size: int  # vLLM's

    @property
    def num_tokens(self) -> int:
        """Tokens the load promised."""
        return len(self.tokens) - self.start

    def filled(self, answered_end: int) -> int:
        """Tokens of the load an answer ending at token `answered_end` (the node's n) covers."""
        return min(max(min(answered_end, len(self.tokens)) - self.start, 0), len(self.block_ids) * self.block_size)

    def blocks_holding(self, tokens: int) -> list[int]:
        """The vLLM blocks the load's first `tokens` tokens are in."""
        return self.block_ids[: -(-tokens // self.block_size)]

    def missed(self, filled: int) -> list[int]:
        """The promised blocks not filled when the load's first `filled` tokens are: from the block the first
        unfilled token is in (vLLM recomputes from that block's start)."""
        return self.block_ids[filled // self.block_size :] if filled < self.num_tokens else []


@dataclass
class _Job:
    """One load of the step: its staging buffer, how far its answer has arrived and been scattered."""

    load: Load
    out: torch.Tensor  # [num_layers, 2, tokens to load, kv_heads, head_dim]
    layers_in: int = 0  # layers scattered into vLLM's blocks (all of the answer's tokens), in order
    answered: int | None = None  # tokens the node answered (known with the first layer, or at the end)
    kv: torch.Tensor | None = None  # the GET's own result, once it returned (what the answer is, in every case)
    done: bool = False
    ready_at_wait: set[int] = field(default_factory=set)  # layers already scattered when the forward waited for them


class LayerwiseLoads:
    """The step's loads, pipelined by layer. `reader()` gives the loads' DataPlaneClient; `pool()` vLLM's paged
    layers and their layout; `count(**stats)` adds to the worker's counters; the loader thread runs on `cpus`
    (kcaas/connectors/io_threads.py; empty: where it is started)."""

    def __init__(
        self,
        reader: Callable,
        pool: Callable,
        bytes_per_token: int,
        timeout_s: float,
        count: Callable,
        cpus: set[int] | None = None,
    ):
        self._reader, self._pool, self._bytes_per_token = reader, pool, bytes_per_token
        self._timeout_s, self._count, self._cpus = timeout_s, count, cpus or set()
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._thread: threading.Thread | None = None
        self._staging: list[torch.Tensor] = []  # flat buffers, one per concurrent load, grown as needed
        self._started = self._arrived = 0.0

    def start(self, loads: list[Load]) -> None:
        """Begin the step's loads on the loader thread (vLLM's start_load_kv)."""
        layers, paged = self._pool()
        self._jobs = [_Job(load, self._buffer(i, layers, paged, load)) for i, load in enumerate(loads)]
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="kcaas-loader", daemon=True)
        self._thread.start()

    def _buffer(self, index: int, layers: list[torch.Tensor], paged: PagedLayout, load: Load) -> torch.Tensor:
        like = layers[0]
        shape = (len(layers), 2, len(load.tokens) - load.start, paged.num_kv_heads, paged.head_dim)
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        while len(self._staging) <= index:
            self._staging.append(torch.empty(0, dtype=like.dtype))
        if self._staging[index].numel() < numel or self._staging[index].dtype != like.dtype:
            self._staging[index] = torch.empty(numel, dtype=like.dtype)  # on the CPU: what the wire lands in
        return self._staging[index][:numel].view(shape)

    def _run(self) -> None:
        bind_current_thread(self._cpus)
        for job in self._jobs:
            load = job.load

            def progress(layers: int, answered: int, job: _Job = job) -> None:
                job.answered = answered
                self._scatter_up_to(job, layers, _answer(job))

            try:
                _, kv = self._reader().get(load.tokens, start=load.start, out=job.out, progress=progress)
                job.answered, job.kv = kv.shape[2], kv
                self._scatter_up_to(job, kv.shape[0], kv)
            except Exception as exc:  # noqa: BLE001 - the node or the network: what did not arrive is recomputed
                logger.warning(
                    "KCaaS load of %d tokens failed (%s): vLLM recomputes them", len(load.tokens) - load.start, exc
                )
            with self._cond:
                job.done = True
                self._cond.notify_all()
        self._arrived = time.perf_counter()

    def _scatter_up_to(self, job: _Job, layers_in: int, answer: torch.Tensor) -> None:
        """On the loader thread: the layers below `layers_in` of the answer not yet scattered, into vLLM's blocks,
        each announced to the forward once it is there."""
        filled = job.load.filled(job.load.start + (job.answered or 0))
        if not filled:
            return
        layers, paged = self._pool()
        blocks = job.load.blocks_holding(filled)
        for index in range(job.layers_in, layers_in):
            with torch.inference_mode():  # the engine's tensors are inference tensors; the mode is per thread
                scatter([layers[index]], paged, blocks, answer[index : index + 1, :, :filled])
            with self._cond:
                job.layers_in = index + 1
                self._cond.notify_all()

    def wait_layer(self, index: int) -> None:
        """Before the attention of layer `index`: wait until the loader scattered that layer of every load (or the
        load ended without it: then its blocks fail)."""
        if not self._jobs:
            return
        waited = time.perf_counter()
        deadline = waited + self._timeout_s * len(self._jobs) + 1.0
        with self._cond:
            for job in self._jobs:
                while not job.done and job.layers_in <= index and time.perf_counter() < deadline:
                    self._cond.wait(timeout=max(deadline - time.perf_counter(), 0.0))
                if job.layers_in > index:
                    job.ready_at_wait.add(index)
        self._count(load_wait_seconds=time.perf_counter() - waited)

    def finish(self) -> set[int]:
        """The step is over: join the loader, and return the promised blocks not filled in every layer before the
        forward read that layer."""
        if self._thread is None:
            return set()
        self._thread.join()
        self._thread = None
        failed: set[int] = set()
        num_layers = len(self._pool()[0])
        for job in self._jobs:
            load = job.load
            whole = len(job.ready_at_wait) == num_layers
            filled = load.filled(load.start + (job.answered or 0)) if whole else 0
            missed = load.missed(filled)
            failed.update(missed)
            self._count(
                loaded_tokens=filled,
                loaded_bytes=filled * self._bytes_per_token,
                load_failures=1 if missed else 0,
                failed_tokens=load.num_tokens - filled,
            )
        self._count(load_seconds=self._arrived - self._started)  # the loads' own time, overlapped with the forward
        self._jobs = []
        return failed


def _answer(job: _Job) -> torch.Tensor:
    """The answer: the GET's result once it returned; before, the staging buffer as the streaming part lays it out
    ([layers, 2, answered, ...] from the buffer's start: the node may answer fewer tokens than there is room for)."""
    if job.kv is not None:
        return job.kv
    layers, _, _, heads, dim = job.out.shape
    answered = job.answered or 0
    return job.out.view(-1)[: layers * 2 * answered * heads * dim].view(layers, 2, answered, heads, dim)
