"""What the vLLM connector needs before the engine serves (no vLLM import): its configuration, read from
`kv_connector_extra_config` and the environment, and the cache it opens with it — the REST client, the cache
(by id or name), the check that the cache was attached for this engine's KV layout, the TLS context of the data
plane and a data-token source. Every problem is a `ConnectorSetupError` with one message that says what to fix:
vLLM refuses to start with it.

The API key is read from the environment variable the configuration names (`api_key_env`, default KCAAS_API_KEY)
and is held only by the REST client, never in the configuration vLLM logs.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Protocol

from kcaas.client import Client
from kcaas.connectors.io_threads import parse_cpu_list
from kcaas.dataplane import DataPlaneClient
from kcaas.errors import KcaasError
from kcaas.spec import IdentityMismatch, KVCacheSpec, SpecError
from kcaas.tls import dataplane_ssl_context, platform_ssl_context
from kcaas.tokens import TokenSource

ROLES = ("kv_both", "kv_producer", "kv_consumer")
SAVE_MODES = ("sync", "async")
LOAD_MODES = ("layerwise", "sync")
KNOWN_KEYS = frozenset(
    {
        "kcaas_url",
        "cache",
        "api_key_env",
        "ca_file",
        "token_ttl_seconds",
        "lookup_timeout_ms",
        "io_timeout_s",
        "save",
        "load",
        "model_fingerprint",
        "save_queue_bytes",
        "io_cpus",
    }
)


class ConnectorSetupError(RuntimeError):
    """The connector cannot serve this engine; the message says why and what to change."""

    def __init__(self, message: str):
        super().__init__(f"KCaaS connector: {message}")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    url: str
    cache: str
    role: str
    api_key_env: str = "KCAAS_API_KEY"
    ca_file: str | None = None
    token_ttl_seconds: int | None = None
    lookup_timeout_s: float = 0.1  # the scheduler's lookup: a slower node is a miss, never a stall
    io_timeout_s: float = 5.0  # a worker's load or save: a hung node costs at most this, then a recompute
    save: str = "async"
    load: str = "layerwise"  # "sync": every layer loaded before the forward
    save_queue_bytes: int = 1 << 30  # async saves waiting for the network; beyond it a save is dropped (a miss)
    model_fingerprint: str | None = None
    io_cpus: str | None = None  # the CPUs of the connector's I/O threads (default: those vLLM's OpenMP leaves out)

    @classmethod
    def from_extra(cls, extra: dict, role: str | None, environ=os.environ) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ConnectorSetupError(f"unknown kv_connector_extra_config keys {unknown} (known: {sorted(KNOWN_KEYS)})")
        if role not in ROLES:
            raise ConnectorSetupError(f"kv_role must be one of {ROLES}, not {role!r}")
        url = extra.get("kcaas_url") or environ.get("KCAAS_URL")
        if not url:
            raise ConnectorSetupError("no control-plane URL: set kv_connector_extra_config.kcaas_url or KCAAS_URL")
        if not extra.get("cache"):
            raise ConnectorSetupError("kv_connector_extra_config.cache (the cache's id or name) is required")
        save = extra.get("save") or ("sync" if role == "kv_producer" else "async")
        if save not in SAVE_MODES:
            raise ConnectorSetupError(f"save must be one of {SAVE_MODES}, not {save!r}")
        load = extra.get("load") or "layerwise"
        if load not in LOAD_MODES:
            raise ConnectorSetupError(f"load must be one of {LOAD_MODES}, not {load!r}")
        io_cpus = extra.get("io_cpus")
        if io_cpus is not None:
            try:
                if not parse_cpu_list(str(io_cpus)):
                    raise ValueError("no CPU")
            except ValueError:
                raise ConnectorSetupError(f"io_cpus must be a CPU list such as '3' or '2-3', not {io_cpus!r}") from None
        try:
            return cls(
                url=str(url),
                cache=str(extra["cache"]),
                role=role,
                api_key_env=str(extra.get("api_key_env") or "KCAAS_API_KEY"),
                ca_file=extra.get("ca_file"),
                token_ttl_seconds=None if extra.get("token_ttl_seconds") is None else int(extra["token_ttl_seconds"]),
                lookup_timeout_s=float(extra.get("lookup_timeout_ms", 100)) / 1000.0,
                io_timeout_s=float(extra.get("io_timeout_s", 5.0)),
                save=save,
                load=load,
                save_queue_bytes=int(extra.get("save_queue_bytes", 1 << 30)),
                model_fingerprint=extra.get("model_fingerprint"),
                io_cpus=None if io_cpus is None else str(io_cpus),
            )
        except (TypeError, ValueError) as exc:
            raise ConnectorSetupError(f"a kv_connector_extra_config value has the wrong type: {exc}") from None

    @property
    def writes(self) -> bool:
        return self.role != "kv_consumer"

    @property
    def reads(self) -> bool:
        return self.role != "kv_producer"


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """What the engine's KV is, from vLLM's own config (one attention group, tensor parallel size 1).

    An MLA engine ('mla') keeps one latent row per token and layer: num_kv_heads 1 and head_dim half the row, as
    KVCacheSpec.latent stores it (kcaas.spec.latent_head_shape)."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int  # vLLM's block size: loads and saves move whole vLLM blocks
    attention: str = "mha"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    block_name: str = "vLLM's block size"  # what the engine calls its block, for the messages that name it

    def spec_with(self, cache_spec: KVCacheSpec) -> KVCacheSpec:
        """This engine's identity in the cache's block size and storage dtype (what the cache must equal)."""
        return KVCacheSpec(
            model_fingerprint=self.model_fingerprint,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=cache_spec.block_size,
            kv_dtype=self.kv_dtype,
            storage_dtype=cache_spec.storage_dtype,
            attention=self.attention,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )


class EngineIdentity(Protocol):
    """What CacheSession checks a cache against: the engine's block (the cache's block size must divide it), what
    the engine calls that block, and the spec the cache must equal in the cache's own block size."""

    @property
    def block_size(self) -> int: ...

    @property
    def block_name(self) -> str: ...

    def spec_with(self, cache_spec: KVCacheSpec) -> KVCacheSpec: ...


class CacheSession:
    """The cache an engine uses, opened and checked (module docstring). `data_plane()` makes a client of it."""

    def __init__(self, config: ConnectorConfig, engine: EngineIdentity, environ=os.environ):
        self.config = config
        key = environ.get(config.api_key_env)
        if not key:
            raise ConnectorSetupError(f"no API key: the environment variable {config.api_key_env} is not set")
        self.client = Client(config.url, key)
        try:
            self.cache = self._resolve(config.cache)
            self.spec = self._checked_spec(engine)
            self.ssl_context = self._ssl_context()
            access = "readwrite" if config.writes else "read"
            self.tokens = TokenSource(self.client, self.cache.id, access, ttl_seconds=config.token_ttl_seconds)
            self.tokens.get()  # a key that may not mint this token fails now, not at the first request
        except KcaasError as exc:
            self.client.close()
            raise ConnectorSetupError(f"the control plane at {config.url} refused: {exc}") from None
        except OSError as exc:
            self.client.close()
            raise ConnectorSetupError(f"cannot reach the control plane at {config.url}: {exc}") from None
        self._keeper = _TokenKeeper(self.tokens)

    def _resolve(self, wanted: str):
        try:
            uuid.UUID(wanted)
            caches = [self.client.get_cache(wanted)]
        except ValueError:
            caches = [c for c in self.client.list_caches() if c.name == wanted and c.state != "detached"]
        except KcaasError as exc:
            if exc.status == 404:
                caches = []
            else:
                raise
        if not caches:
            raise ConnectorSetupError(f"no cache {wanted!r} for this API key (attach it first: kcaas attach)")
        ready = [c for c in caches if c.is_ready]
        if not ready:
            raise ConnectorSetupError(f"cache {wanted!r} is {caches[0].state}, not ready")
        return ready[0]

    def _checked_spec(self, engine: EngineIdentity) -> KVCacheSpec:
        cache_spec = self.cache.spec
        if engine.block_size % cache_spec.block_size:
            raise ConnectorSetupError(
                f"cache {self.config.cache!r} has block_size {cache_spec.block_size}, which "
                f"does not divide {engine.block_name} {engine.block_size}"
            )
        try:
            wanted = engine.spec_with(cache_spec)
            cache_spec.check_matches(wanted)
        except (IdentityMismatch, SpecError) as exc:
            raise ConnectorSetupError(
                f"cache {self.config.cache!r} was attached for another KV layout: {exc}"
            ) from None
        return cache_spec

    def _ssl_context(self):
        if self.config.ca_file:
            try:
                with open(self.config.ca_file) as f:
                    return dataplane_ssl_context(f.read())
            except (OSError, ValueError) as exc:
                raise ConnectorSetupError(f"cannot use ca_file {self.config.ca_file!r}: {exc}") from None
        return platform_ssl_context(self.config.url)

    def data_plane(self, *, timeout: float, overloaded_retries: int = 8) -> DataPlaneClient:
        return DataPlaneClient(
            self.cache.endpoint,
            self.tokens,
            self.cache.id,
            self.spec,
            ssl_context=self.ssl_context,
            timeout=timeout,
            max_overloaded_retries=overloaded_retries,
        )

    def close(self) -> None:
        self._keeper.stop()
        self.client.close()


class _TokenKeeper:
    """Refreshes the data token in the background, so no request on the engine's path waits for the control plane
    (TokenSource refreshes ahead of expiry; a failed refresh keeps the old token while it is valid)."""

    def __init__(self, tokens: TokenSource, period_s: float = 5.0):
        self._tokens, self._period = tokens, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kcaas-token-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._tokens.get()
            except KcaasError:
                pass  # the control plane is away: the data plane keeps the token it has until it expires

    def stop(self) -> None:
        self._stop.set()
