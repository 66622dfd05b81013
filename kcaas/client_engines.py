"""kcaas.Client's engine instances (KV-aware routing, docs/routing.md): register the tenant's vLLM instances, list
and forget them, and ask which of them holds a prompt's longest prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kcaas.client_transport import API_PREFIX, RestTransport, _segment


@dataclass(frozen=True)
class EngineInstance:
    id: str
    name: str
    model: str
    block_size: int
    api_base: str
    events_endpoint: str
    replay_endpoint: str
    state: str  # live | lost
    next_seq: int
    events_applied: int
    gaps: int
    requests_waiting: int | None = None  # its queue at the last health check (None: the engine does not report it)
    requests_running: int | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> EngineInstance:
        return cls(**{name: body[name] for name in cls.__dataclass_fields__ if name in body})


@dataclass(frozen=True)
class PrefixHit:
    """One instance's answer: per medium (GPU, CPU, STORAGE, ...), the longest prefix of the prompt it holds in that
    medium or a faster one, in tokens."""

    id: str
    name: str
    api_base: str
    block_size: int
    prefix_tokens: dict[str, int]
    used_blocks: int
    requests_waiting: int | None = None  # its queue, as it reports it (None: unreported)
    requests_running: int | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PrefixHit:
        return cls(**{name: body[name] for name in cls.__dataclass_fields__ if name in body})


@dataclass(frozen=True)
class CachePrefixHit:
    """One cache's answer: per tier (GPU, CPU, STORAGE, NETWORK), the longest prefix of the prompt it holds in that
    tier or a faster one, in tokens."""

    id: str
    name: str
    block_size: int
    prefix_tokens: dict[str, int]
    used_blocks: int

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CachePrefixHit:
        return cls(**{name: body[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class PrefixLookup:
    """A lookup's answer: the tenant's live instances serving the model, and its followed caches."""

    instances: list[PrefixHit]
    caches: list[CachePrefixHit]


class EngineMethods(RestTransport):
    """/engines."""

    def register_engine(
        self, name: str, *, model: str, block_size: int, api_base: str, events_endpoint: str, replay_endpoint: str = ""
    ) -> EngineInstance:
        """Register an engine instance (vLLM with --kv-events-config publishing over ZMQ) for KV-aware routing.

        Returns: the EngineInstance, live, its index empty.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (ConflictError 409 name_taken,
            ValidationError 400 endpoint_not_allowed / invalid_endpoint), APIConnectionError.
        """
        body = {
            "name": name,
            "model": model,
            "block_size": block_size,
            "api_base": api_base,
            "events_endpoint": events_endpoint,
            "replay_endpoint": replay_endpoint,
        }
        return EngineInstance.from_json(self._request("POST", f"{API_PREFIX}/engines", json_body=body).body)

    def engines(self) -> list[EngineInstance]:
        """The tenant's engine instances and their index state."""
        return [EngineInstance.from_json(e) for e in self._request("GET", f"{API_PREFIX}/engines").body]

    def deregister_engine(self, instance_id: str) -> None:
        """Forget an instance and what the index holds of it. Raises NotFoundError (404) for an unknown id."""
        self._request("DELETE", f"{API_PREFIX}/engines/{_segment(instance_id)}")

    def prefix_lookup(self, model: str, token_ids: list[int], *, lora_name: str | None = None) -> PrefixLookup:
        """Each live instance serving `model` and each ready cache of the tenant, with the longest prefix of
        `token_ids` it holds per medium (a read: safe to retry)."""
        body = {"model": model, "token_ids": list(token_ids), "lora_name": lora_name}
        answer = self._request("POST", f"{API_PREFIX}/engines/lookup", json_body=body, repeatable=True).body
        return PrefixLookup(
            [PrefixHit.from_json(hit) for hit in answer["instances"]],
            [CachePrefixHit.from_json(hit) for hit in answer["caches"]],
        )
