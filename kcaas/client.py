"""The KCaaS REST client: caches, data tokens and API keys over the control plane's JSON API.

Standard library only (http.client), so `pip install kcaas` stays light:

    import kcaas
    client = kcaas.Client("https://kcaas.example.com", api_key)
    cache = client.attach("chat", spec, {"device": 2 << 30})      # waits for `ready`
    tokens = kcaas.TokenSource(client, cache.id, access="readwrite")
    tokens.get().token                                            # a fresh data-plane token, refreshed ahead of expiry

`Client` is assembled from one module per resource over one transport:
- kcaas/client_transport.py: connections (one keep-alive connection per thread), retries within a time budget,
  typed errors that never carry the API key, pagination; its docstring says what is retried and when;
- kcaas/client_caches.py: caches (attach, wait_for, list, get, detach) and their data tokens (issue, revoke);
- kcaas/client_keys.py: API keys (list, get, create, revoke, rotate);
- kcaas/client_engines.py: engine instances for KV-aware routing (register, list, deregister, prefix_lookup);
- here: who the key belongs to (whoami) and the tenant's quota and usage (usage).

Answers: the response models (Cache, DataToken, ApiKeyInfo, IssuedKey, Principal) live in kcaas.resources and are
re-exported here; the quota view (Usage) in kcaas.usage; the transport's helpers (retry sets, backoff) in kcaas._http.
"""

from __future__ import annotations

from datetime import datetime

from kcaas._http import retry_after as _retry_after  # noqa: F401 - importable from here, as before the split
from kcaas.client_caches import CacheMethods
from kcaas.client_engines import EngineInstance, EngineMethods, PrefixHit  # noqa: F401 - re-exported
from kcaas.client_keys import KeyMethods
from kcaas.client_transport import API_PREFIX, HINTLESS_RETRIES, USER_AGENT, __version__  # noqa: F401 - the API
from kcaas.resources import ApiKeyInfo, Cache, DataToken, IssuedKey, Principal  # noqa: F401 - re-exported
from kcaas.usage import Usage


class Client(CacheMethods, KeyMethods, EngineMethods):
    """A tenant's handle on the KCaaS REST API. Thread-safe: each thread gets its own keep-alive connection."""

    def __repr__(self) -> str:
        return f"Client(base_url={self.base_url!r}, api_key={self._key_hint!r})"

    # -- who am I -------------------------------------------------------------------------------------------------

    def whoami(self) -> Principal:
        """Who this API key belongs to (GET /whoami): its tenant, key id and scopes.

        Returns: the Principal.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (AuthenticationError 401),
            APIConnectionError when the control plane cannot be reached.
        """
        return Principal.from_json(self._request("GET", f"{API_PREFIX}/whoami").body)

    def usage(
        self, *, from_: datetime | str | None = None, to: datetime | str | None = None, granularity: str | None = None
    ) -> Usage:
        """The tenant's effective quota limits, what counts against them, and the bytes resident (GET /usage);
        with `from_` and `to` (and `granularity` hour|day|month, default day) also the metered series
        (`Usage.series`). Datetimes should be timezone-aware (UTC).

        Returns: the Usage (with `series` when `from_` and `to` are given).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (AuthenticationError 401,
            ValidationError 400 for a bad range or granularity), APIConnectionError when the control plane cannot be
            reached.
        """
        query = {"from": _timestamp(from_), "to": _timestamp(to), "granularity": granularity}
        return Usage.from_json(self._request("GET", f"{API_PREFIX}/usage", query=query).body)


def _timestamp(moment: datetime | str | None) -> str | None:
    """An ISO 8601 query value: datetimes as isoformat, text as given."""
    return moment.isoformat() if isinstance(moment, datetime) else moment
