"""KCaaSTier: a KCaaS cache as a secondary tier of vLLM's OffloadingConnector (TieringOffloadingSpec).

vLLM keeps its CPU primary tier, its events and its metrics; this tier moves whole offload chunks between that
primary tier's slots and a KCaaS cache, each chunk a named page (kcaas/connectors/vllm_tier_io.py). Selected with
vLLM's own configuration (docs/vllm.md, "vLLM's offloading tier"):

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": N,
        "secondary_tiers": [{"type": "KCaaSTier", "module_path": "kcaas.connectors.vllm_tier",
                             "kcaas_url": URL, "cache": NAME, "ca_file": PEM}]}

Every method runs on vLLM's scheduler thread and returns at once (SecondaryTierManager's contract):

    lookup(key)           HIT / MISS from an asynchronous batched lookup (vLLM's AsyncLookupManager); RETRY while
                          it is in flight. A failed lookup is a MISS.
    submit_store(job)     queues a put of the job's primary slots; the job fails if any chunk is not cached whole
    submit_load(job)      queues a get into the job's primary slots; keys that did not arrive whole are failed
                          (`successful_keys` names the rest) and marked missing, so vLLM recomputes them
    get_finished_jobs()   the JobResults of jobs finished since the last call
    drain_jobs()          blocks until no transfer touches the primary tier (bounded by io_timeout_s per request)

Configuration and session (URL, cache, API key, TLS, data tokens) are the KV connector's own
(kcaas/connectors/vllm_session.py); the cache must be attached with the model's spec, which is checked at start
against vLLM's model name, dtype and chunk size. Tenant isolation is the data token's: another tenant's key finds
nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from typing_extensions import override
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kcaas.connectors.vllm_session import CacheSession, ConnectorConfig, ConnectorSetupError
from kcaas.connectors.vllm_tier_io import TRANSFER_ERRORS, ChunkGeometry, ChunkStore
from kcaas.connectors.vllm_tier_jobs import Finished, Job, TransferThread
from kcaas.spec import KVCacheSpec

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KCaaSTier", "TIER_KEYS"]

TIER_KEYS = frozenset(
    {"kcaas_url", "cache", "ca_file", "api_key_env", "token_ttl_seconds", "io_timeout_s", "model_fingerprint"}
)


class KCaaSTier(SecondaryTierManager):
    """A KCaaS cache behind vLLM's CPU primary tier (module docstring). Owns two threads: lookups (vLLM's
    AsyncLookupManager) and transfers (TransferThread), each with its own data-plane connection."""

    medium: ClassVar[Medium | None] = None  # a network service: vLLM reports its hits as external
    locality_default: ClassVar[Locality] = Locality.REMOTE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **options,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality else self.locality_default
        config = tier_config(options)
        geometry = chunk_geometry(offloading_spec, primary_kv_view)
        self.session = CacheSession(config, _ChunkLayout.of(offloading_spec, geometry, config))
        try:
            slots = np.asarray(primary_kv_view)  # zero copy: the primary tier's mmap, one row per slot
            store = ChunkStore(self.session, geometry, slots, timeout=config.io_timeout_s)  # checks the cache
        except BaseException:
            self.session.close()
            raise
        self.geometry = geometry
        self._transfers = TransferThread(store)
        self._lookups = _Lookups(store, tier_type)
        self._jobs_keys: dict[int, list[OffloadKey]] = {}  # job id -> its keys, until its JobResult is taken

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS once the batched lookup answered, RETRY until then (sent at this step's end)."""
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the put of the job's slots (non-blocking)."""
        self._submit(job_metadata, is_load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue the get into the job's slots (non-blocking)."""
        self._submit(job_metadata, is_load=True)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """JobResults of the jobs finished since the last call; a load's failed keys are marked missing."""
        return [self._result(done) for done in self._transfers.finished()]

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs_keys)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context) -> None:
        """Send this step's lookups as one batch."""
        self._lookups.flush()

    @override
    def drain_jobs(self) -> None:
        """Block until no queued or running transfer touches the primary tier."""
        self._transfers.drain()

    @override
    def shutdown(self) -> None:
        """Stop both threads (queued transfers finish as failures) and close the session."""
        self._lookups.shutdown()
        self._transfers.close()
        self.session.close()

    def _submit(self, job_metadata: TransferJob, *, is_load: bool) -> None:
        keys = list(job_metadata.keys)
        self._jobs_keys[job_metadata.job_id] = keys
        slots = [int(s) for s in job_metadata.chunk_ids]
        self._transfers.submit(Job(job_metadata.job_id, keys, slots, is_load))

    def _result(self, done: Finished) -> JobResult:
        keys = self._jobs_keys.pop(done.job_id, list(done.keys))
        failed = keys[done.whole :]
        if failed:
            self._lookups.mark_miss(failed)  # else vLLM would ask to promote the same chunk again and again
        return JobResult(
            job_id=done.job_id,
            success=done.success,
            successful_keys=None if done.success or not done.whole else tuple(keys[: done.whole]),
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes or None,
        )


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookup state machine over a ChunkStore of its own (its own connection)."""

    def __init__(self, store: ChunkStore, tier_type: str):
        self._store = store.for_thread()
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Whether each chunk is cached whole; a failed lookup is all misses."""
        try:
            return self._store.exists(keys)
        except TRANSFER_ERRORS:
            return [False] * len(keys)

    def shutdown(self) -> None:
        super().shutdown()
        self._store.close()


def tier_config(options: dict) -> ConnectorConfig:
    """The tier's secondary_tiers entry (less type, module_path, locality, backpressure) as a ConnectorConfig."""
    unknown = sorted(set(options) - TIER_KEYS)
    if unknown:
        raise ConnectorSetupError(f"unknown KCaaSTier keys {unknown} (known: {sorted(TIER_KEYS)})")
    return ConnectorConfig.from_extra(options, "kv_both", environ=os.environ)


def chunk_geometry(offloading_spec: OffloadingSpec, primary_kv_view: memoryview) -> ChunkGeometry:
    """A chunk's tokens, KV bytes and host layout, from vLLM's offloading config (one KV cache group only)."""
    config = offloading_spec.config
    if len(config.groups) != 1:
        raise ConnectorSetupError(f"KCaaSTier stores one KV cache group, this model has {len(config.groups)}")
    parallel = config.parallel
    copies = 1 if offloading_spec.replicated_layout else parallel.world_size
    payload = config.worker_kv_bytes_per_block * offloading_spec.blocks_per_chunk * copies
    slot_bytes = (primary_kv_view.strides or (primary_kv_view.nbytes,))[0]
    if payload <= 0 or payload > slot_bytes:
        raise ConnectorSetupError(f"vLLM's chunk of {payload} bytes does not fit its {slot_bytes}-byte slot")
    layout = "canonical" if config.canonical_layout else f"{config.kv_cache_layout or 'direct'}-ws{copies}"
    tokens = config.groups[0].tokens_per_block * offloading_spec.blocks_per_chunk
    return ChunkGeometry(tokens_per_chunk=tokens, payload_bytes=payload, layout=layout)


@dataclass(frozen=True)
class _ChunkLayout:
    """What CacheSession checks a cache against (an EngineIdentity), for a tier that knows vLLM's
    model name, dtype and chunk size but not its heads: the cache's own sizes, this engine's fingerprint and dtype
    (ChunkStore then checks that the cache's bytes per token fill a chunk exactly)."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int  # tokens per chunk: the cache's block size must divide it
    block_name: str = "vLLM's offload chunk"

    @classmethod
    def of(cls, offloading_spec: OffloadingSpec, geometry: ChunkGeometry, config: ConnectorConfig) -> _ChunkLayout:
        model = offloading_spec.config.model
        fingerprint = config.model_fingerprint or f"{model.name}@main"
        return cls(fingerprint, str(model.dtype).removeprefix("torch."), geometry.tokens_per_chunk)

    def spec_with(self, cache_spec: KVCacheSpec) -> KVCacheSpec:
        return KVCacheSpec(
            **{**cache_spec.to_dict(), "model_fingerprint": self.model_fingerprint, "kv_dtype": self.kv_dtype}
        )
