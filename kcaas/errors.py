"""Typed errors of the KCaaS SDK.

Every non-2xx answer of the control plane (`{"error": {"code", "message", "details"}}`) becomes a `KcaasError`
subclass chosen by status and code, carrying `status`, `code`, `message`, `details`, `request_id` (when the server
or a proxy sent one) and, for 429, `retry_after`. Nothing here ever holds the API key: the client scrubs it from
every message and detail before an error is built.

Each error also carries a `hint`: what to do about it, for the codes an engine developer meets on day one (an unknown
key, no node with room, a control plane that is not running, a node certificate this client does not trust); given
explicitly, from the server's `details.hint`, or from `hint_for`. `str(error)` is the message, the details and the
hint, so a traceback alone says what went wrong and what to try.
"""

from __future__ import annotations

import re
from typing import Any

CA_URL_PATH = "/.well-known/kcaas-ca.pem"
AUTHENTICATION_CODES = (
    "not_authenticated",
    "authentication_failed",
    "malformed_api_key",
    "invalid_api_key",
    "api_key_revoked",
    "api_key_expired",
)


class KcaasError(Exception):
    """Base of every SDK error. `status` is None for errors that never got an HTTP answer."""

    default_code = "error"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        request_id: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code or self.default_code
        self.details = details or {}
        self.request_id = request_id
        self.hint = hint or hint_for(self.code, self.message, self.details) or _sent_hint(self.details)

    def __str__(self) -> str:
        parts = [f"[{self.status}]" if self.status is not None else None, f"{self.code}:", self.message]
        shown = {k: v for k, v in self.details.items() if k != "hint"}
        if shown:
            parts.append(f"(details: {shown})")
        if self.request_id:
            parts.append(f"(request id {self.request_id})")
        if self.hint:
            parts.append(f"-- hint: {self.hint}")
        return " ".join(p for p in parts if p)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r}, "
            f"details={self.details!r}, request_id={self.request_id!r}, hint={self.hint!r})"
        )


class APIConnectionError(KcaasError):
    """The request got no HTTP answer (refused, reset, timed out, TLS failure), after any retries allowed."""

    default_code = "connection_error"


class AuthenticationError(KcaasError):
    """401: missing, malformed, unknown, revoked or expired key, or an inactive tenant (see `code`)."""

    default_code = "authentication_failed"


class PermissionDeniedError(KcaasError):
    """403: the key lacks a scope (details.required_scope / details.not_held)."""

    default_code = "permission_denied"


class QuotaExceededError(KcaasError):
    """403 `quota_exceeded`: details.limit names the limit. Not retried: free capacity, then try again."""

    default_code = "quota_exceeded"


class NotFoundError(KcaasError):
    """404: no such resource for this tenant (another tenant's ids are 404s too)."""

    default_code = "not_found"


class ConflictError(KcaasError):
    """409: e.g. cache_name_taken, cache_not_ready, idempotency_in_progress."""

    default_code = "conflict"


class ValidationError(KcaasError):
    """400 or 422: invalid_spec, invalid_capacity, validation_error (details.fields), idempotency_key_reused."""

    default_code = "validation_error"


class RateLimitedError(KcaasError):
    """429: the tenant's request rate; `retry_after` seconds (float) as the server asked, or None."""

    default_code = "rate_limited"

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(KcaasError):
    """5xx."""

    default_code = "server_error"


class ServiceUnavailableError(ServerError):
    """503: e.g. no_capacity (no node can place the cache)."""

    default_code = "service_unavailable"


class CacheFailedError(KcaasError):
    """A cache reached `failed` while the client waited for it; `cache` holds it (failure_reason, id to detach)."""

    default_code = "cache_failed"

    def __init__(self, message: str, *, cache: Any = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.cache = cache


class WaitTimeoutError(KcaasError, TimeoutError):
    """A wait for a cache state ran past its timeout (also a builtin TimeoutError); `cache` is its last state."""

    default_code = "wait_timeout"

    def __init__(self, message: str, *, cache: Any = None, **kwargs: Any) -> None:
        KcaasError.__init__(self, message, **kwargs)
        self.cache = cache


def error_class_for(status: int, code: str | None) -> type[KcaasError]:
    """The exception class for an HTTP error status and the body's code."""
    if code == "quota_exceeded":
        return QuotaExceededError
    if status == 401:
        return AuthenticationError
    if status == 403:
        return PermissionDeniedError
    if status == 404:
        return NotFoundError
    if status == 409:
        return ConflictError
    if status in (400, 422):
        return ValidationError
    if status == 429:
        return RateLimitedError
    if status == 503:
        return ServiceUnavailableError
    if status >= 500:
        return ServerError
    return KcaasError


def is_certificate_failure(message: str) -> bool:
    """A TLS failure because the peer's certificate is not trusted (or not for that name)."""
    return "CERTIFICATE_VERIFY_FAILED" in message or "certificate verify failed" in message.lower()


def hint_for(code: str, message: str, details: dict[str, Any]) -> str | None:
    """What to do about an error with this code, message and details; None when there is nothing useful to say."""
    node = details.get("endpoint") or details.get("uds_path")  # set by the data plane: the node's own address
    if is_certificate_failure(message):
        return _certificate_hint(node, details.get("url") or _url_in(message))
    if code == "no_capacity":
        return _no_capacity_hint(details)
    if code in AUTHENTICATION_CODES:
        return (
            "pass api_key= or set KCAAS_API_KEY to a valid key (`make up` writes its demo tenant's key to "
            "var/secrets/demo-api-key); create a new one with `kcaas keys create` if it was revoked or expired"
        )
    if code == "connection_error" and node:
        return (
            f"the node at {node} (the cache's data-plane address) did not answer: its node agent may be down or "
            "restarting; the control plane moves the cache to another node (`kcaas show CACHE` shows where), "
            "then connect again"
        )
    if code == "connection_error" and ("refused" in message.lower() or "Could not connect" in message):
        url = details.get("url") or _url_in(message) or "the control plane URL"
        return (
            f"is the control plane running at {url}? Start it with `make up`, or point KCAAS_URL (or url=) at "
            "your KCaaS deployment"
        )
    if code == "quota_exceeded":
        return "detach caches you no longer need (details.limit names the limit), or ask for a higher quota"
    if code == "cache_not_ready":
        return "wait for the cache to be ready (Client.wait_for) before asking for a data token"
    if code == "cache_name_taken":
        return _name_taken_hint(details)
    return None


def _name_taken_hint(details: dict[str, Any]) -> str:
    """The name is held by a cache that is not detached: say which, and the two ways on (use it, or free the name)."""
    name = details.get("name") or "NAME"
    held = ", ".join(f"{key} {details[key]}" for key in ("cache_id", "state") if details.get(key))
    which = f"a cache named {name} already exists ({held})" if held else f"a cache named {name} already exists"
    return (
        f"{which}: use it as is (`kcaas show {name}`, kc.cache({name!r})) if its spec fits, or detach it first "
        f"(`kcaas detach {name} --wait`) or pick another name"
    )


def _certificate_hint(node: str | None, url: str | None) -> str:
    """An untrusted certificate: whose it was (a node's on the data plane, else the control plane's) and what to do."""
    if not node:
        where = f"the control plane at {url}" if url else "the control plane"
        return (
            f"{where} presents a certificate this client does not trust: pass ca= (a PEM file or text) or use "
            "an https:// URL whose certificate the system trusts"
        )
    return (
        f"the node at {node} presents a certificate not signed by a CA this client trusts: connect with "
        f"kcaas.connect(url) (it trusts the CA the control plane publishes at <url>{CA_URL_PATH}), or pass ca= (a PEM "
        "file or text; `make up` writes var/secrets/dev-ca.pem)"
    )


def _no_capacity_hint(details: dict[str, Any]) -> str:
    free = details.get("largest_free")
    asked = f"ask for at most {free} bytes per tier (the largest free on any node), " if free else "ask for less, "
    return (
        f"{asked}or start the node agents with more memory (KCAAS_NODE_DEVICE_BYTES, KCAAS_NODE_DRAM_BYTES, "
        "KCAAS_NODE_SSD_BYTES)"
    )


def _url_in(message: str) -> str | None:
    found = re.search(r"https?://[^\s:/]+(?::\d+)?[^\s:]*", message)
    return found.group(0) if found else None


def _sent_hint(details: dict[str, Any]) -> str | None:
    sent = details.get("hint")
    return sent if isinstance(sent, str) and sent else None
