"""kcaas.Client's caches and their data tokens: attach (and wait until ready), poll a cache's state, list, get,
detach, recover (a cache whose node was lost, from the network tier); issue and revoke the short-lived data-plane
tokens of a cache."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from kcaas.client_transport import API_PREFIX, RestTransport, _segment
from kcaas.errors import CacheFailedError, WaitTimeoutError
from kcaas.resources import Cache, DataToken
from kcaas.spec import KVCacheSpec


class CacheMethods(RestTransport):
    """/caches and /caches/{id}/tokens."""

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
        network_write_through: bool = False,
    ) -> Cache:
        """Attach a cache (POST /caches) and, with `wait`, poll until it is `ready`. Raises CacheFailedError if
        provisioning failed (its `failure_reason` in the message; detach it to free the quota) and WaitTimeoutError
        (a TimeoutError) after `timeout` seconds. Retries are safe: one Idempotency-Key serves every attempt.
        `progress(cache)` is called with the cache as first answered and after each poll (see wait_for).
        `capacity` may name "network" bytes (the fleet's network store); `network_write_through` acknowledges a put
        only once its full blocks are in it (needs network bytes).

        Returns: the Cache (ready with `wait`).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
            CacheFailedError, WaitTimeoutError with `wait`.
        """
        spec_body = spec.to_dict() if isinstance(spec, KVCacheSpec) else dict(spec)
        body: dict[str, Any] = {"name": name, "spec": spec_body, "capacity": dict(capacity)}
        if network_write_through:
            body["network_write_through"] = True
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
        given, sees every state polled (the first one included) before it is checked.

        Returns: the Cache in `state`.
        Raises: WaitTimeoutError past `timeout`; CacheFailedError if it fails; a kcaas.errors.KcaasError subclass
            carrying the API's code (e.g. NotFoundError 404), APIConnectionError when the control plane cannot be
            reached.
        """
        deadline = time.monotonic() + timeout
        delay = 0.05
        cache = current or self.get_cache(cache_id)
        while True:
            if progress is not None:
                progress(cache)
            if cache.state == state:
                return cache
            _check_can_reach(cache, state)
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
        """Every cache of this tenant (all pages), optionally only those in `state`.

        Returns: the caches, every page.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
        """
        return [Cache.from_json(item) for item in self._paginate(f"{API_PREFIX}/caches", {"state": state})]

    def get_cache(self, cache_id: str) -> Cache:
        return Cache.from_json(self._request("GET", f"{API_PREFIX}/caches/{_segment(cache_id)}").body)

    def detach(self, cache_id: str, *, wait: bool = False, timeout: float = 60.0) -> Cache:
        """Detach (idempotent): the cache goes `detaching` (its tokens are revoked), then `detached`.

        Returns: the Cache (detached with `wait`).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
        """
        cache = Cache.from_json(self._request("DELETE", f"{API_PREFIX}/caches/{_segment(cache_id)}").body)
        if wait and cache.state != "detached":
            return self.wait_for(cache.id, "detached", timeout=timeout, current=cache)
        return cache

    def recover(self, cache_id: str, *, wait: bool = False, timeout: float = 60.0) -> Cache:
        """Recover a cache whose node was lost (failed, node_lost) from the network tier: it is placed on another
        node at a new epoch (POST /caches/{id}/recover) and, with `wait`, polled until `ready`. 409
        (ConflictError) with code cache_not_node_lost or cache_without_network_tier when there is nothing to
        recover. Not retried blindly: a second call on a recovered cache is a 409, never a second placement.

        Returns: the Cache, placed again (ready with `wait`).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
            ConflictError when it cannot be recovered (its code says why).
        """
        path = f"{API_PREFIX}/caches/{_segment(cache_id)}/recover"
        cache = Cache.from_json(self._request("POST", path, json_body={}).body)
        if wait and cache.state != "ready":
            return self.wait_for(cache.id, "ready", timeout=timeout, current=cache)
        return cache

    def issue_token(self, cache_id: str, *, access: str = "read", ttl_seconds: int | None = None) -> DataToken:
        """A short-lived data-plane token for a ready cache (409 cache_not_ready before). `access` "read" (lookup and
        get; the default, as for the REST API) or "readwrite" (also put and delete). Not retried on errors without an
        answer: each issue counts against max_data_tokens_outstanding.

        Returns: the DataToken.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
            ConflictError cache_not_ready.
        """
        body: dict[str, Any] = {"access": access}
        if ttl_seconds is not None:
            body["ttl_seconds"] = int(ttl_seconds)
        path = f"{API_PREFIX}/caches/{_segment(cache_id)}/tokens"
        return DataToken.from_json(self._request("POST", path, json_body=body).body)

    def revoke_token(self, cache_id: str, jti: str | None = None) -> int:
        """Revoke one data token of the cache (`jti`), or all its outstanding ones; the node refuses them at once
        (at the latest at its next heartbeat), also on open connections. Idempotent; returns how many were revoked.

        Returns: how many were revoked.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (e.g. NotFoundError 404, QuotaExceededError,
            ServiceUnavailableError 503 no_capacity), APIConnectionError when the control plane cannot be reached.
        """
        tail = f"/{_segment(jti)}/revoke" if jti is not None else "/revoke"
        path = f"{API_PREFIX}/caches/{_segment(cache_id)}/tokens{tail}"
        return int(self._request("POST", path, json_body={}).body["revoked"])


def _check_can_reach(cache: Cache, state: str) -> None:
    """CacheFailedError when `cache` can no longer get to `state`: it failed, or it is being detached."""
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
