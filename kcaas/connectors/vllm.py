"""vLLM KV connector: a vLLM engine stores and loads its prompts' KV through a KCaaS cache (vLLM's out-of-tree
connector API, KVConnectorBase_V1). docs/vllm.md is the user's page; this is how it works.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KCaaSConnector",
        "kv_connector_module_path": "kcaas.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kcaas_url": "http://127.0.0.1:8000", "cache": "chat"}}'

Scheduler side (one instance in the engine core):
  * `get_num_new_matched_tokens`: one LOOKUP per request on the node (remembered for the request: vLLM may ask
    again), bounded by `lookup_timeout_ms`; a node that fails or times out is a miss, and lookups are skipped for a
    back-off after it (no request waits on a dead node twice). What may load: whole cache blocks (the cache's block
    size divides vLLM's, so a hit may end inside a vLLM block: vLLM computes the rest of it), never the prompt's
    last token, beyond vLLM's own local hit.
  * `build_connector_meta`: per step, the loads promised (tokens, the vLLM blocks to fill) and the saves due: a
    request whose prompt was computed this step saves its prompt's whole cache blocks not already in the cache.
Worker side (one instance per worker):
  * `start_load_kv`: GET of the promised tokens (only those beyond vLLM's local hit cross the wire), scattered into
    the blocks vLLM allocated: by default streamed on a loader thread, each layer scattered in `wait_for_layer_load`
    right before its attention (kcaas/connectors/vllm_loads.py); with `load: "sync"`, all layers before the
    forward. Tokens the node no longer has (evicted, node gone)
    are reported by `get_block_ids_with_load_errors`, and vLLM recomputes them (the connector sets
    kv_load_failure_policy to "recompute": a KCaaS miss is never a failed request). Wrong KV is never loaded: what
    arrives is what the node verified for exactly these tokens.
  * `save_kv_layer` / `wait_for_save`: the saves' blocks are copied out of vLLM's pool layer by layer as the
    forward writes each layer (a copier thread, beside the forward: kcaas/connectors/vllm_saves.py), all of them
    before wait_for_save returns (so vLLM keeps no block for us), and PUT: in wait_for_save (`save: "sync"`, the
    default of kv_producer, so a consumer finds the KV once the producer's request returned) or by a background
    thread (`save: "async"`, the default otherwise; a bounded queue, a save that does not fit is dropped and
    counted).
Roles: kv_both loads and saves; kv_producer saves only; kv_consumer loads only, with a read-only data token.
Identity: the cache's KVCacheSpec must equal the engine's (layers, KV heads, head size, dtype, fingerprint
"<model>@<revision>"; for an MLA model the latent spec: attention 'mla', kv_lora_rank, qk_rope_head_dim), and its
block size must divide vLLM's; otherwise vLLM refuses to start with the mismatch named.
Limits: tensor parallel size 1, one attention group (no hybrid or sliding-window groups), prompt blocks only (the
KV of generated tokens is not saved), the CPU and CUDA flash-attention paged layouts and the MLA backends' latent
rows, unquantized (kcaas/connectors/vllm_blocks.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kcaas.connectors.vllm_blocks import BACKEND_LAYOUTS, CacheWrite, loadable_tokens, savable_tokens
from kcaas.connectors.vllm_lookup import BoundedLookup
from kcaas.connectors.vllm_session import CacheSession, ConnectorConfig, ConnectorSetupError, EngineLayout
from kcaas.connectors.vllm_worker import ConnectorWorker, Load, Save
from kcaas.spec import latent_head_shape

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kcaas.connectors.vllm")

# the worker's counters (lookups are vLLM's own: vllm:external_prefix_cache_queries / _hits)
STAT_NAMES = (
    "loaded_tokens",
    "loaded_bytes",
    "load_seconds",
    "load_failures",
    "failed_tokens",
    "load_wait_seconds",
    "save_wait_seconds",
    "save_layers_copied_late",
    "saved_tokens",
    "saved_bytes",
    "save_failures",
    "saves_dropped",
)


class KCaaSConnectorStats(KVConnectorStats):
    """Counters of one logging interval (sums): what vLLM's stats logger and Prometheus exporter receive."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in STAT_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class KCaaSMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one step: the loads to do before the forward, the saves after it."""

    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class _Tracked:
    """A running request as the scheduler side follows it: its prompt, its vLLM blocks so far, what the cache
    already holds of it, and whether its save was emitted."""

    prompt: list[int]
    block_ids: list[int]
    cached_in_kcaas: int = 0
    saved: bool = False


def engine_layout(vllm_config: VllmConfig, kv_cache_config, fingerprint: str | None) -> EngineLayout:
    """The engine's KV layout from vLLM's config; refuses what the connector does not support."""
    if vllm_config.parallel_config.tensor_parallel_size != 1 or vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ConnectorSetupError("tensor and pipeline parallel size must be 1")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConnectorSetupError(f"the model has {len(groups)} KV cache groups; only one attention group is supported")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None) or not hasattr(spec, "num_kv_heads"):
        raise ConnectorSetupError(f"{type(spec).__name__} KV (sliding window or non-attention) is not supported")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ConnectorSetupError(f"kv cache dtype {cache_dtype!r}: only the model's own dtype ('auto') is supported")
    model = vllm_config.model_config
    common = dict(
        model_fingerprint=fingerprint or f"{model.model}@{model.revision or 'main'}",
        num_layers=len(groups[0].layer_names),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        block_size=vllm_config.cache_config.block_size,
    )
    if isinstance(spec, MLAAttentionSpec):
        return _latent_layout(model.hf_text_config, spec.head_size, common)
    return EngineLayout(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, **common)


def _latent_layout(text_config, row_width: int, common: dict[str, Any]) -> EngineLayout:
    """An MLA engine's layout: one latent row (kv_lora_rank + qk_rope_head_dim wide) per token and layer.
    Refuses rows that are not exactly that (a packed or quantized latent)."""
    rank, rope = getattr(text_config, "kv_lora_rank", None), getattr(text_config, "qk_rope_head_dim", None)
    if not isinstance(rank, int) or not isinstance(rope, int) or rank + rope != row_width:
        raise ConnectorSetupError(
            f"vLLM's MLA rows are {row_width} wide; the connector stores kv_lora_rank + qk_rope_head_dim "
            f"({rank} + {rope}) unpacked"
        )
    num_kv_heads, head_dim = latent_head_shape(rank, rope)
    return EngineLayout(
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention="mla",
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        **common,
    )


def _backend_name(layer) -> str:
    """The attention backend of one of vLLM's attention layers (its get_name(): CPU_ATTN, FLASH_ATTN, ...)."""
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else f"unknown ({type(layer).__name__})"


def _cache_write(backend: str, layer) -> CacheWrite | None:
    """The backend's own cache-write op, as vllm_blocks.PagedLayout.probed runs it, or None where the connector
    cannot run it here (the CUDA backends without MLA: their layouts come from their documented views).

    CPU_ATTN: `cpu_attn_reshape_and_cache` on the layer viewed as the backend's forward views it, with the ISA the
    backend chose for this layer (`layer.isa`, set by its metadata builder before the connector sees the caches).
    MLA backends: the layer's own `impl.do_kv_cache_update` (on the layer's device, CPU or CUDA).
    Raises ConnectorSetupError if that ISA is not known."""
    if BACKEND_LAYOUTS.get(backend) == "latent":
        return _latent_cache_write(layer)
    if backend != "CPU_ATTN":
        return None
    from vllm import _custom_ops as vllm_ops

    isa = getattr(layer, "isa", None)
    if not isinstance(isa, str):
        raise ConnectorSetupError("the CPU attention backend did not say which kernel ISA writes its KV cache")

    def write(paged: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        num_blocks, num_heads, block_size, _ = paged.shape
        key_cache, value_cache = paged.view(num_blocks, num_heads, block_size * 2, -1).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def _latent_cache_write(layer) -> CacheWrite:
    """An MLA layer's cache write as a CacheWrite: KCaaS's K and V planes ([tokens, 1, width / 2] each) are the
    latent row's halves; the row's first kv_lora_rank values go in as kv_c_normed, the rest as k_pe."""
    impl = layer.impl
    rank = impl.kv_lora_rank
    scale = getattr(layer, "_k_scale", None)

    def write(paged: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        rows = torch.cat([key, value], dim=-1).flatten(1)  # [tokens, kv_lora_rank + qk_rope_head_dim]
        k_scale = scale if scale is not None else torch.ones(1, device=paged.device)
        kv_c_normed, k_pe = rows[:, :rank].contiguous(), rows[:, rank:].unsqueeze(1).contiguous()
        impl.do_kv_cache_update(kv_c_normed, k_pe, paged, slots, "auto", k_scale)

    return write


class KCaaSConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, transfer.kv_role)
        self._layout = engine_layout(vllm_config, kv_cache_config, self._config.model_fingerprint)
        self._block_size = self._layout.block_size  # vLLM's
        self._session = CacheSession(self._config, self._layout)
        self._hit_unit = self._session.spec.block_size  # the cache's (divides vLLM's): what a hit is counted in
        logger.info(
            "KCaaS connector (%s, %s): cache %s at %s",
            role.name.lower(),
            self._config.role,
            self._session.cache.id,
            self._session.cache.endpoint,
        )
        if role == KVConnectorRole.SCHEDULER:
            transfer.kv_load_failure_policy = "recompute"  # read by the scheduler after it made this connector
            session, config = self._session, self._config
            self._lookup = BoundedLookup(
                lambda timeout: session.data_plane(timeout=timeout, overloaded_retries=0),
                config.lookup_timeout_s,
                config.io_timeout_s,
            )
            self._tracked: dict[str, _Tracked] = {}
            self._hits: dict[str, int] = {}  # request id -> tokens the cache holds (one lookup per request)
            self._pending_loads: dict[str, tuple[int, int]] = {}  # request id -> (local hit, tokens to load)
            self._local_hits: dict[str, int] = {}  # request id -> vLLM's own hit when the connector was asked
            self._worker: ConnectorWorker | None = None
        else:
            self._worker = ConnectorWorker(self._session, self._config, self._layout)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, not a lost hand-off

    # ---- worker side --------------------------------------------------------------------------------------------
    def _worker_side(self) -> ConnectorWorker:
        """The worker half. Raises RuntimeError on the scheduler's connector (vLLM calls worker hooks on workers)."""
        if self._worker is None:
            raise RuntimeError("a worker hook was called on the scheduler-side KCaaS connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        backends = {_backend_name(layers.get(name)) for name in kv_caches}
        first = min(kv_caches)
        write = _cache_write(_backend_name(layers.get(first)), layers.get(first)) if len(backends) == 1 else None
        self._worker_side().register(kv_caches, backends, write)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if metadata.loads:
            self._worker_side().load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_layer(layer_name)  # layerwise: this layer of the step's loads, once arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        saves = self._get_connector_metadata().saves  # bound before the forward (start_load_kv may come after it)
        self._worker_side().layer_saved(layer_name, saves)  # copied out now, beside the rest of the forward

    def wait_for_save(self) -> None:
        self._worker_side().finish_loads()  # the forward is over: loads joined
        saves = self._get_connector_metadata().saves
        self._worker_side().finish_saves(saves)  # copies joined; PUT now (sync) or on the saver thread (async)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_failed_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._worker.take_stats() if self._worker is not None else {}
        return KCaaSConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KCaaSConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        else:
            self._lookup.close()
        self._session.close()

    # ---- scheduler side -----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        if request.request_id not in self._hits:  # a producer looks up too: its save sends only what is missing
            self._hits[request.request_id] = self._lookup(prompt)
        if not self._config.reads:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        loadable = loadable_tokens(self._hits[request.request_id], len(prompt), self._hit_unit)
        return max(loadable - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            local = self._local_hits.get(request.request_id, 0)
            self._pending_loads[request.request_id] = (local, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KCaaSMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked[new.req_id] = _Tracked(list(new.prompt_token_ids or []), list(new.block_ids[0]))
            tracked.cached_in_kcaas = self._hits.get(new.req_id, 0)
            self._emit_load(new.req_id, tracked, meta)
            self._emit_save(tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            running = self._tracked.get(req_id)
            if running is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # back from preemption: its blocks were all given again
                running.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                running.block_ids.extend(new_blocks[0])
            self._emit_load(req_id, running, meta)
            self._emit_save(running, cached.num_computed_tokens[index] + scheduled.get(req_id, 0), meta)
        return meta

    def _emit_load(self, req_id: str, tracked: _Tracked, meta: KCaaSMetadata) -> None:
        planned = self._pending_loads.pop(req_id, None)
        if planned is None:
            return
        local, count = planned  # local: whole vLLM blocks; count: whole cache blocks (may end inside a vLLM block)
        first, last = local // self._block_size, -(-(local + count) // self._block_size)
        tokens = np.asarray(tracked.prompt[: local + count], dtype=np.int32)
        meta.loads.append(Load(req_id, tokens, local, tracked.block_ids[first:last], self._block_size))

    def _emit_save(self, tracked: _Tracked, computed: int, meta: KCaaSMetadata) -> None:
        if not self._config.writes or tracked.saved or computed < len(tracked.prompt):
            return
        tracked.saved = True
        end = savable_tokens(len(tracked.prompt), self._hit_unit)
        have = min(tracked.cached_in_kcaas, end) // self._hit_unit * self._hit_unit
        blocks = -(-end // self._block_size)
        if end > have and blocks <= len(tracked.block_ids):
            meta.saves.append(Save(np.asarray(tracked.prompt[:end], dtype=np.int32), have, tracked.block_ids[:blocks]))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._local_hits.pop(request.request_id, None)
        return False, None
