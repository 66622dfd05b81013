"""The REST API's response models, as `kcaas.Client` returns them: Cache, DataToken, ApiKeyInfo, IssuedKey and
Principal (frozen dataclasses built with `from_json`; fields a newer server adds are ignored). The quota view,
`kcaas.Usage`, lives in kcaas.usage. Re-exported by kcaas.client and kcaas, so `from kcaas.client import Cache` works.

Standard library only, like the client.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kcaas.spec import KVCacheSpec


def _parse_time(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `cls` present in `data`: unknown fields (newer servers) are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _spec_from(data: Any) -> KVCacheSpec | None:
    if not isinstance(data, Mapping):
        return None
    names = {f.name for f in dataclasses.fields(KVCacheSpec)}
    try:
        return KVCacheSpec(**{k: v for k, v in data.items() if k in names})
    except (TypeError, ValueError):
        return None  # a layout this SDK version does not understand: `raw` still has it


@dataclass(frozen=True, kw_only=True)
class Cache:
    id: str
    name: str
    state: str
    tenant_id: str | None = None
    spec: KVCacheSpec | None = None
    capacity: Mapping[str, int] = field(default_factory=dict)  # device, dram, ssd, network (the fleet's store)
    network_write_through: bool = False  # puts are acknowledged once their full blocks are in the network store
    block_bytes: int | None = None
    failure_reason: str = ""
    node_id: str | None = None
    endpoint: str = ""
    epoch: int = 0
    contents: str = ""  # "warm" | "cold" (cold: its node came back without it, no block reported since)
    emptied_at: datetime | None = None  # when its node last came back without it (None: never)
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cache:
        values = _known(cls, data)
        values["spec"] = _spec_from(data.get("spec"))
        values["capacity"] = dict(data.get("capacity") or {})
        values["failure_reason"] = data.get("failure_reason") or ""
        values["endpoint"] = data.get("endpoint") or ""
        values["contents"] = data.get("contents") or ""
        for name in ("created_at", "updated_at", "emptied_at"):
            values[name] = _parse_time(data.get(name))
        return cls(**values)

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True, kw_only=True)
class DataToken:
    token: str = field(repr=False)  # a bearer credential: kept out of reprs and logs
    cache_id: str
    access: str
    expires_at: datetime
    token_type: str = "Bearer"
    jti: str | None = None
    epoch: int | None = None
    node_id: str | None = None
    endpoint: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataToken:
        values = _known(cls, data)
        values["expires_at"] = _parse_time(data.get("expires_at"))
        return cls(**values)

    def claims(self) -> dict[str, Any]:
        """The token's payload, decoded WITHOUT verification (for the client's own bookkeeping: exp, iat, epoch)."""
        try:
            payload = self.token.split(".")[1]
            return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (IndexError, ValueError):
            return {}

    @property
    def authorization(self) -> str:
        return f"{self.token_type} {self.token}"


@dataclass(frozen=True, kw_only=True)
class ApiKeyInfo:
    id: str
    name: str = ""
    public_id: str = ""
    scopes: tuple[str, ...] = ()
    state: str = "active"
    tenant_id: str | None = None
    created_at: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    use_count: int = 0
    rotated_from: str | None = None

    @classmethod
    def _values(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        values = _known(cls, data)
        values["scopes"] = tuple(data.get("scopes") or ())
        values["name"] = data.get("name") or ""
        for name in ("created_at", "expires_at", "revoked_at", "last_used_at"):
            values[name] = _parse_time(data.get(name))
        return values

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ApiKeyInfo:
        return cls(**cls._values(data))


@dataclass(frozen=True, kw_only=True)
class IssuedKey(ApiKeyInfo):
    """A newly issued (or rotated-to) key: `key` is the raw secret, shown by the server this once."""

    key: str = field(repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IssuedKey:
        return cls(**cls._values(data))


@dataclass(frozen=True, kw_only=True)
class Principal:
    """The caller as the control plane sees it (GET /whoami)."""

    kind: str
    tenant_id: str | None = None
    key_id: str | None = None
    scopes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Principal:
        values = _known(cls, data)
        values["scopes"] = tuple(data.get("scopes") or ())
        return cls(**values)
