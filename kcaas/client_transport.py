"""The transport under kcaas.Client (kcaas/client.py): connections, requests, retries, errors and pagination over
the control plane's JSON API. The resource methods live in kcaas/client_caches.py (caches, data tokens) and
kcaas/client_keys.py (API keys); this module knows no resource.

Standard library only (http.client), so `pip install kcaas` stays light.

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
in both cases the server did nothing. The API marks what is transient with Retry-After: its own error answer without
one (503 no_capacity: no node has the room, which waiting seconds will not change) is final and raised at once; an
answer that is not the API's (a gateway's 502/503/504, no error code) is retried at most HINTLESS_RETRIES (3)
times. Other POSTs (create/rotate key, issue token) are never repeated after a lost answer or a 5xx: the server may
have acted, so the caller decides.
`retries=0` turns retrying off.

Errors: every non-2xx answer raises a typed `kcaas.errors.KcaasError` subclass; the API key never appears in an
error's message, details or repr, nor in the client's repr. The transport's stateless helpers (retry sets, backoff,
Retry-After, key redaction) are in kcaas._http.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self
from urllib.parse import quote, urlencode, urlsplit

from kcaas import errors
from kcaas._http import (
    IDEMPOTENT_METHODS,
    REQUEST_ID_HEADERS,
    RETRY_STATUSES,
)
from kcaas._http import ConnectFailed as _ConnectFailed
from kcaas._http import Response as _Response
from kcaas._http import backoff as _full_jitter
from kcaas._http import dropped as _dropped
from kcaas._http import parse_body as _parse_body
from kcaas._http import redact_key as _redact_key
from kcaas._http import retry_after as _retry_after
from kcaas.errors import APIConnectionError, KcaasError, RateLimitedError

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


def _in_progress(response: _Response, error: KcaasError) -> bool:
    """409 idempotency_in_progress: the server is still running our own earlier attempt."""
    return response.status == 409 and error.code == "idempotency_in_progress"


def _hinted(response: _Response, error: KcaasError) -> bool:
    """The answer says it passes soon: a Retry-After, or our own attempt still running."""
    has_hint = getattr(error, "retry_after", None) is not None or _retry_after(response.headers) is not None
    return has_hint or _in_progress(response, error)


def _api_answer(response: _Response) -> bool:
    """Whether an error answer is the API's own (its error envelope), not a proxy's or gateway's."""
    body = response.body
    return isinstance(body, Mapping) and isinstance(body.get("error"), Mapping) and bool(body["error"].get("code"))


def _segment(value: Any) -> str:
    """One path segment, percent-encoded (an id never reaches another path)."""
    return quote(str(value), safe="")


class RestTransport:
    """Connections, requests with retries, typed errors and pagination for one API key. Thread-safe: each thread
    gets its own keep-alive connection. kcaas.Client adds the resources' methods."""

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

    def __enter__(self) -> Self:
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
                delay: float | None = self._backoff(attempt)
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

    def _retry_delay(
        self, response: _Response, error: KcaasError, attempt: int, repeatable: bool, hintless: int
    ) -> float | None:
        """How long to wait before trying an answered request again, or None when it must not be repeated."""
        retry_code = _in_progress(response, error)
        # 429 is retried for every request: the throttle refuses before the view runs, so nothing happened
        retry = response.status == 429 or (repeatable and (response.status in RETRY_STATUSES or retry_code))
        if not retry:
            return None
        retry_after = getattr(error, "retry_after", None) or _retry_after(response.headers)
        if retry_after is None:
            if _in_progress(response, error):
                return self._backoff(attempt)
            # The API's own answer without a hint that it passes (503 no_capacity: no node has the room) is final;
            # the API marks what is transient with Retry-After. A gateway's answer (no API error code) gets a few
            # tries, not the whole budget.
            return self._backoff(attempt) if not _api_answer(response) and hintless < HINTLESS_RETRIES else None
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
        details: Mapping[str, Any]
        if isinstance(envelope, Mapping):
            code = str(envelope.get("code") or "") or None
            message = str(envelope.get("message") or "")
            sent_details = envelope.get("details")
            details = sent_details if isinstance(sent_details, Mapping) else {}
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
