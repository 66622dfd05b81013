"""The KCaaS REST client: caches, data tokens and API keys over the control plane's JSON API.

Standard library only (http.client), so `pip install kcaas` stays light:

    import kcaas
    client = kcaas.Client("https://kcaas.example.com", api_key)
    cache = client.attach("chat", spec, {"device": 2 << 30})      # waits for `ready`
    tokens = kcaas.TokenSource(client, cache.id, access="readwrite")
    tokens.get().token                                            # a fresh data-plane token, refreshed ahead of expiry

Connections: one keep-alive HTTP/1.1 connection per thread (http.client objects are not thread-safe), reused across
requests; a connection the server closed while idle is detected before it is reused (as urllib3 does) and reopened.

Retries ride out a restart or short outage of the control plane or its database (seconds, not minutes): a repeatable
call keeps trying while the wait before its next attempt still ends within `retry_budget` seconds (default 30) of
the call's start, with at most `retries` (default 20) extra attempts; so it gives up after about half a minute (plus
the last attempt's own `timeout`), and even the shortest jittered waits add up to over 10 s first. Waits are
exponential backoff with full jitter (`backoff_base` doubling up to `backoff_max`); a Retry-After (the control
plane's 503 `database_unavailable`/`broker_unavailable` and 429s send one) is honoured up to `max_retry_after`. What
is retried: requests that are safe to repeat — GET and DELETE, POST /caches (it carries an Idempotency-Key generated
once per call and reused by every attempt) and key revocation (idempotent on the server) — on connection errors,
429, 502, 503, 504 (and 409 idempotency_in_progress: the server still running our own earlier attempt). Any request
is retried when the connection could not even be opened, and on 429 (the rate limiter refuses before the view runs):
in both cases the server did nothing. An error answer without Retry-After (a gateway's 502/504, 503 no_capacity:
nothing says it passes in seconds) is retried at most HINTLESS_RETRIES (3) times. Other POSTs (create/rotate key, issue token) are never repeated after a lost
answer or a 5xx: the server may have acted, so the caller decides. `retries=0` turns retrying off.

Errors: every non-2xx answer raises a typed `kcaas.errors.KcaasError` subclass; the API key never appears in an
error's message, details or repr, nor in this client's repr.

Answers: the response models (Cache, DataToken, ApiKeyInfo, IssuedKey, Principal) live in kcaas.resources and are
re-exported here; the quota view (Usage) in kcaas.usage; the transport's helpers (retry sets, backoff) in kcaas._http.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import ssl
import threading
import time
import uuid
from datetime import datetime
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import quote, urlencode, urlsplit

from kcaas import errors
from kcaas._http import (
    IDEMPOTENT_METHODS,
    REQUEST_ID_HEADERS,
    RETRY_STATUSES,
    ConnectFailed as _ConnectFailed,
    Response as _Response,
    backoff as _full_jitter,
    dropped as _dropped,
    parse_body as _parse_body,
    redact_key as _redact_key,
    retry_after as _retry_after,
)
from kcaas.errors import APIConnectionError, CacheFailedError, KcaasError, RateLimitedError, WaitTimeoutError
from kcaas.resources import ApiKeyInfo, Cache, DataToken, IssuedKey, Principal
from kcaas.spec import KVCacheSpec
from kcaas.usage import Usage

API_PREFIX = "/api/v1"


def _sdk_version() -> str:
    try:
        from importlib.metadata import version

        return version("kcaas")
    except Exception:  # noqa: BLE001 - not installed (a source checkout): still identify ourselves
        return "0.0.0"


__version__ = _sdk_version()
USER_AGENT = f"kcaas-sdk/{__version__}"
HINTLESS_RETRIES = 3  # retries of an error answer that carries no Retry-After


# ---- the transport ---------------------------------------------------------------------------------------------------



def _in_progress(response: _Response, error: KcaasError) -> bool:
    """409 idempotency_in_progress: the server is still running our own earlier attempt."""
    return response.status == 409 and error.code == "idempotency_in_progress"


def _hinted(response: _Response, error: KcaasError) -> bool:
    """The answer says it passes soon: a Retry-After, or our own attempt still running."""
    has_hint = getattr(error, "retry_after", None) is not None or _retry_after(response.headers) is not None
    return has_hint or _in_progress(response, error)

class Client:
    """A tenant's handle on the KCaaS REST API. Thread-safe: each thread gets its own keep-alive connection."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        retries: int = 20,
        retry_budget: float | None = 30.0,
        backoff_base: float = 0.2,
        backoff_max: float = 8.0,
        max_retry_after: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL")
        if not api_key or not isinstance(api_key, str):
            raise ValueError("api_key is required")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        root = parts.path.rstrip("/")
        if root.endswith(API_PREFIX):  # accept https://host/api/v1 as well as https://host
            root = root[: -len(API_PREFIX)]
        self._root = root
        self.base_url = f"{parts.scheme}://{parts.netloc}{root}"
        self.__api_key = api_key
        self._key_hint = _redact_key(api_key)
        self.timeout = float(timeout)
        self.retries = max(0, int(retries))
        self.retry_budget = None if retry_budget is None else max(0.0, float(retry_budget))
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_retry_after = max_retry_after
        self._ssl_context = ssl_context
        self._local = threading.local()
        self._connections: set[http.client.HTTPConnection] = set()  # every thread's, so close() can close them all
        self._connections_lock = threading.Lock()
        self.page_size = 100  # list pages requested (the server caps it at 500)
        self._sleep: Callable[[float], None] = time.sleep
        self._clock: Callable[[], float] = time.monotonic  # the retry budget's clock (tests pair it with _sleep)

    def __repr__(self) -> str:
        return f"Client(base_url={self.base_url!r}, api_key={self._key_hint!r})"

    # -- connections ----------------------------------------------------------------------------------------------

    def _new_connection(self) -> http.client.HTTPConnection:
        if self._scheme == "https":
            context = self._ssl_context or ssl.create_default_context()
            return http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=context)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, opened if needed; (connection, reused)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            conn.close()  # the server closed it while idle: reusing it would fail half-way through a request
        if conn is None:
            conn = self._local.conn = self._new_connection()
        if conn.sock is None:
            with self._connections_lock:
                self._connections.add(conn)  # (again, if close() dropped it)
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
            return conn, False
        return conn, True

    def close(self) -> None:
        """Close every thread's connection (a later request opens a new one). Call it when done, not mid-request."""
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            conn.close()
        self._local.conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _send_once(self, method: str, target: str, body: bytes | None, headers: dict[str, str]) -> _Response:
        conn, _reused = self._connection()
        try:
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        names = {k.lower(): v for k, v in response.getheaders()}
        return _Response(response.status, names, _parse_body(raw))

    # -- requests, retries, errors --------------------------------------------------------------------------------

    def _target(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        target = path if path.startswith(self._root + "/") and self._root else self._root + path
        if query:
            items = {k: v for k, v in query.items() if v is not None}
            if items:
                target += ("&" if "?" in target else "?") + urlencode(items)
        return target

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        query: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        repeatable: bool | None = None,
    ) -> _Response:
        method = method.upper()
        target = self._target(path, query)
        headers = {
            "Authorization": f"Bearer {self.__api_key}",
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
        }
        body = None
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            headers["Content-Type"] = "application/json"
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        if repeatable is None:
            repeatable = method in IDEMPOTENT_METHODS or idempotency_key is not None

        deadline = None if self.retry_budget is None else self._clock() + self.retry_budget
        hintless = 0  # error answers retried so far that carried no Retry-After
        for attempt in itertools.count():
            try:
                response = self._send_once(method, target, body, headers)
            except _ConnectFailed as exc:  # nothing was sent: any request may go again
                failure: KcaasError = APIConnectionError(self._scrub(f"Could not connect to {self.base_url}: {exc}"))
                delay = self._backoff(attempt)
            except (OSError, http.client.HTTPException) as exc:  # sent: the server may have acted
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {type(exc).__name__}: {exc}"
                note = "" if repeatable else " (not retried: not idempotent)"
                failure = APIConnectionError(self._scrub(f"{method} {path} {what}{note}"))
                delay = self._backoff(attempt) if repeatable else None
            else:
                if 200 <= response.status < 300:
                    return response
                failure = self._error(response)
                delay = self._retry_delay(response, failure, attempt, repeatable, hintless)
                hintless += delay is not None and not _hinted(response, failure)
            if delay is None or not self._may_retry(attempt, delay, deadline):
                raise failure
            self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _retry_delay(self, response: _Response, error: KcaasError, attempt: int, repeatable: bool,
                     hintless: int) -> float | None:  # fmt: skip
        """How long to wait before trying an answered request again, or None when it must not be repeated."""
        retry_code = _in_progress(response, error)
        # 429 is retried for every request: the throttle refuses before the view runs, so nothing happened
        retry = response.status == 429 or (repeatable and (response.status in RETRY_STATUSES or retry_code))
        if not retry:
            return None
        retry_after = getattr(error, "retry_after", None) or _retry_after(response.headers)
        if retry_after is None:
            # no hint that it passes soon (a gateway error, 503 no_capacity): a few tries, not the whole budget
            return self._backoff(attempt) if _hinted(response, error) or hintless < HINTLESS_RETRIES else None
        # the server's hint, plus a little jitter so throttled clients do not stampede back together
        return min(retry_after, self.max_retry_after) + random.uniform(0, 0.1)

    def _may_retry(self, attempt: int, delay: float, deadline: float | None) -> bool:
        """Another attempt is made while fewer than `retries` retries were made and waiting `delay` still ends
        within the retry budget: a call never sleeps past its budget."""
        return attempt < self.retries and (deadline is None or self._clock() + delay <= deadline)

    def _backoff(self, attempt: int) -> float:
        return _full_jitter(attempt, self.backoff_base, self.backoff_max)

    def _scrub(self, text: str) -> str:
        key = self.__api_key
        if key and key in text:
            text = text.replace(key, self._key_hint)
        tail = key.rsplit("_", 1)[-1] if "_" in key else ""
        for secret in (tail, tail[:-6]):  # <secret><crc> and the bare secret (crc: 6 chars)
            if len(secret) >= 16 and secret in text:
                text = text.replace(secret, "***")
        return text

    def _scrub_obj(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._scrub(value)
        if isinstance(value, Mapping):
            return {self._scrub(str(k)): self._scrub_obj(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._scrub_obj(v) for v in value]
        return value

    def _error(self, response: _Response) -> KcaasError:
        body = response.body
        envelope = body.get("error") if isinstance(body, Mapping) else None
        if isinstance(envelope, Mapping):
            code = str(envelope.get("code") or "") or None
            message = str(envelope.get("message") or "")
            details = envelope.get("details") if isinstance(envelope.get("details"), Mapping) else {}
        else:
            code, details = None, {}
            message = body if isinstance(body, str) and body else ""
        message = message or http.client.responses.get(response.status, "HTTP error")
        request_id = next((response.headers[h] for h in REQUEST_ID_HEADERS if h in response.headers), None)
        cls = errors.error_class_for(response.status, code)
        kwargs: dict[str, Any] = dict(
            status=response.status, code=code, details=self._scrub_obj(dict(details)), request_id=request_id
        )
        if cls is RateLimitedError:
            kwargs["retry_after"] = _retry_after(response.headers)
        return cls(self._scrub(message), **kwargs)

    def _paginate(self, path: str, query: Mapping[str, Any] | None = None) -> Iterator[Any]:
        response = self._request("GET", path, query={"limit": self.page_size, **(query or {})})
        while True:
            body = response.body
            if isinstance(body, list):  # an unpaginated list
                yield from body
                return
            yield from body.get("results") or []
            following = body.get("next")
            if not following:
                return
            parts = urlsplit(following)  # follow on our own connection; never to another host
            response = self._request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))

    # -- who am I -------------------------------------------------------------------------------------------------

    def whoami(self) -> Principal:
        return Principal.from_json(self._request("GET", f"{API_PREFIX}/whoami").body)

    def usage(self, *, from_: datetime | str | None = None, to: datetime | str | None = None,
              granularity: str | None = None) -> Usage:
        """The tenant's effective quota limits, what counts against them, and the bytes resident (GET /usage);
        with `from_` and `to` (and `granularity` hour|day|month, default day) also the metered series
        (`Usage.series`). Datetimes should be timezone-aware (UTC)."""
        query = {"from": _timestamp(from_), "to": _timestamp(to), "granularity": granularity}
        return Usage.from_json(self._request("GET", f"{API_PREFIX}/usage", query=query).body)

    # -- caches ---------------------------------------------------------------------------------------------------

    def attach(
        self,
        name: str,
        spec: KVCacheSpec | Mapping[str, Any],
        capacity: Mapping[str, int],
        *,
        wait: bool = True,
        timeout: float = 60.0,
        idempotency_key: str | None = None,
        progress: Callable[[Cache], None] | None = None,
    ) -> Cache:
        """Attach a cache (POST /caches) and, with `wait`, poll until it is `ready`. Raises CacheFailedError if
        provisioning failed (its `failure_reason` in the message; detach it to free the quota) and WaitTimeoutError
        (a TimeoutError) after `timeout` seconds. Retries are safe: one Idempotency-Key serves every attempt.
        `progress(cache)` is called with the cache as first answered and after each poll (see wait_for)."""
        spec_body = spec.to_dict() if isinstance(spec, KVCacheSpec) else dict(spec)
        body = {"name": name, "spec": spec_body, "capacity": dict(capacity)}
        key = idempotency_key or f"kcaas-{uuid.uuid4()}"
        cache = Cache.from_json(self._request("POST", f"{API_PREFIX}/caches", json_body=body, idempotency_key=key).body)
        if not wait:
            return cache
        return self.wait_for(cache.id, "ready", timeout=timeout, current=cache, progress=progress)

    def wait_for(
        self,
        cache_id: str,
        state: str = "ready",
        *,
        timeout: float = 60.0,
        current: Cache | None = None,
        progress: Callable[[Cache], None] | None = None,
    ) -> Cache:
        """Poll GET /caches/{id} (backing off from 50 ms to 1 s) until the cache is in `state`; `progress(cache)`, if
        given, sees every state polled (the first one included) before it is checked."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        cache = current or self.get_cache(cache_id)
        while True:
            if progress is not None:
                progress(cache)
            if cache.state == state:
                return cache
            if cache.state == "failed" and state != "failed":
                raise CacheFailedError(
                    f"Cache {cache.id} failed: {cache.failure_reason or 'no reason given'}",
                    code="cache_failed",
                    details={"cache_id": cache.id, "failure_reason": cache.failure_reason},
                    cache=cache,
                )
            if cache.state in ("detaching", "detached") and state not in ("detaching", "detached"):
                raise CacheFailedError(
                    f"Cache {cache.id} is {cache.state}",
                    code="cache_detached",
                    details={"cache_id": cache.id},
                    cache=cache,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(
                    f"Cache {cache.id} is still {cache.state} after {timeout:g} s (waiting for {state})",
                    details={"cache_id": cache.id, "state": cache.state},
                    cache=cache,
                )
            self._sleep(min(delay, remaining))
            delay = min(delay * 1.6, 1.0)
            cache = self.get_cache(cache_id)

    def list_caches(self, *, state: str | None = None) -> list[Cache]:
        """Every cache of this tenant (all pages), optionally only those in `state`."""
        return [Cache.from_json(item) for item in self._paginate(f"{API_PREFIX}/caches", {"state": state})]

    def get_cache(self, cache_id: str) -> Cache:
        return Cache.from_json(self._request("GET", f"{API_PREFIX}/caches/{_segment(cache_id)}").body)

    def detach(self, cache_id: str, *, wait: bool = False, timeout: float = 60.0) -> Cache:
        """Detach (idempotent): the cache goes `detaching` (its tokens are revoked), then `detached`."""
        cache = Cache.from_json(self._request("DELETE", f"{API_PREFIX}/caches/{_segment(cache_id)}").body)
        if wait and cache.state != "detached":
            return self.wait_for(cache.id, "detached", timeout=timeout, current=cache)
        return cache

    def issue_token(self, cache_id: str, *, access: str = "readwrite", ttl_seconds: int | None = None) -> DataToken:
        """A short-lived data-plane token for a ready cache (409 cache_not_ready before). Not retried on errors
        without an answer: each issue counts against max_data_tokens_outstanding."""
        body: dict[str, Any] = {"access": access}
        if ttl_seconds is not None:
            body["ttl_seconds"] = int(ttl_seconds)
        path = f"{API_PREFIX}/caches/{_segment(cache_id)}/tokens"
        return DataToken.from_json(self._request("POST", path, json_body=body).body)

    def revoke_token(self, cache_id: str, jti: str | None = None) -> int:
        """Revoke one data token of the cache (`jti`), or all its outstanding ones; the node refuses them at once
        (at the latest at its next heartbeat), also on open connections. Idempotent; returns how many were revoked."""
        tail = f"/{_segment(jti)}/revoke" if jti is not None else "/revoke"
        path = f"{API_PREFIX}/caches/{_segment(cache_id)}/tokens{tail}"
        return int(self._request("POST", path, json_body={}).body["revoked"])

    # -- API keys -------------------------------------------------------------------------------------------------

    def list_keys(self) -> list[ApiKeyInfo]:
        return [ApiKeyInfo.from_json(item) for item in self._paginate(f"{API_PREFIX}/keys")]

    def get_key(self, key_id: str) -> ApiKeyInfo:
        return ApiKeyInfo.from_json(self._request("GET", f"{API_PREFIX}/keys/{_segment(key_id)}").body)

    def create_key(
        self, scopes: list[str] | tuple[str, ...], name: str = "", expires_in_seconds: int | None = None
    ) -> IssuedKey:
        body = {"scopes": list(scopes), "name": name, "expires_in_seconds": expires_in_seconds}
        return IssuedKey.from_json(self._request("POST", f"{API_PREFIX}/keys", json_body=body).body)

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revoking is idempotent on the server (the first time is kept), so this request is retried."""
        path = f"{API_PREFIX}/keys/{_segment(key_id)}/revoke"
        return ApiKeyInfo.from_json(self._request("POST", path, repeatable=True).body)

    def rotate_key(self, key_id: str, overlap_seconds: int | None = None) -> IssuedKey:
        """A successor key now; the old one keeps working for `overlap_seconds` (server default 1 h). If it is this
        client's own key, make a new Client with the successor's `key`."""
        body = {} if overlap_seconds is None else {"overlap_seconds": int(overlap_seconds)}
        path = f"{API_PREFIX}/keys/{_segment(key_id)}/rotate"
        return IssuedKey.from_json(self._request("POST", path, json_body=body).body)


def _segment(value: Any) -> str:
    return quote(str(value), safe="")


def _timestamp(moment: datetime | str | None) -> str | None:
    """An ISO 8601 query value: datetimes as isoformat, text as given."""
    return moment.isoformat() if isinstance(moment, datetime) else moment
