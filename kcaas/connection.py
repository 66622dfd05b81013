"""`kcaas.connect()`: one call from a URL and an API key to a ready data-plane client for a cache.

    import kcaas
    kc = kcaas.connect()                          # KCAAS_URL (default http://127.0.0.1:8000) and KCAAS_API_KEY
    dp = kc.cache("chat", access="readwrite")     # a connected kcaas.DataPlaneClient
    dp.put(token_ids, kv); n, kv = dp.get(token_ids)

`Connection.cache()` does what an engine otherwise assembles by hand: it finds the cache by name or id (kcaas.Client),
waits until it is `ready` (bounded: WaitTimeoutError), keeps a data token for it (kcaas.TokenSource at the access asked
for), trusts the node's certificate through the CA the control plane publishes (`GET /.well-known/kcaas-ca.pem`,
fetched once per Connection) unless `ca=` pins one, and opens the TLS 1.3 connection (HELLO included), so a wrong
CA, a bad token or an identity mismatch fails here and not on the first put. A certificate the client does not trust
raises CertificateVerifyError, whose message says what to pass.
"""

from __future__ import annotations

import os
import ssl
import threading
import uuid
from pathlib import Path
from typing import Any

from kcaas import tls
from kcaas.client import Cache, Client
from kcaas.dataplane import DataPlaneClient
from kcaas.errors import APIConnectionError, KcaasError, NotFoundError, is_certificate_failure
from kcaas.spec import KVCacheSpec
from kcaas.tokens import TokenSource

DEFAULT_URL = "http://127.0.0.1:8000"  # what `make up` serves
ACCESS_LEVELS = ("read", "readwrite")
LIVE_STATES = ("pending", "provisioning", "ready")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # a node bound to every address: its certificate names localhost


class CertificateVerifyError(APIConnectionError):
    """TLS refused the peer's certificate (CERTIFICATE_VERIFY_FAILED): this client does not trust its CA."""

    default_code = "certificate_verify_failed"


def connect(
    url: str | None = None,
    api_key: str | None = None,
    *,
    ca: str | os.PathLike | None = None,
    verify: bool = True,
    **client_options: Any,
) -> Connection:
    """A Connection to the control plane at `url` (default $KCAAS_URL, else http://127.0.0.1:8000) with `api_key`
    (default $KCAAS_API_KEY). `ca`: the CA that signs the nodes' data-plane certificates, a PEM file path or PEM text
    (default: fetched from the control plane). `verify=False` skips certificate checks on the data plane (a local
    experiment only: anyone on the path can read the KV). `client_options` go to kcaas.Client (timeout, retries...).

    Returns: the Connection (nothing is fetched until it is used).
    Raises: KcaasError `not_authenticated` when no API key is given or set.
    """
    url = url or os.environ.get("KCAAS_URL") or DEFAULT_URL
    api_key = api_key or os.environ.get("KCAAS_API_KEY", "").strip()
    if not api_key:
        raise KcaasError(
            "no API key: pass api_key= or set KCAAS_API_KEY",
            code="not_authenticated",
            details={"url": url},
        )
    return Connection(Client(url, api_key, **client_options), ca=ca, verify=verify)


class Connection:
    """A tenant's handle on KCaaS: `client` (kcaas.Client, the REST API) and `cache()` for data-plane clients.
    Thread-safe; close() (or `with`) closes the REST client and every data-plane client it made."""

    def __init__(self, client: Client, *, ca: str | os.PathLike | None = None, verify: bool = True) -> None:
        self.client = client
        self.url = client.base_url
        self._ca = ca
        self._verify = verify
        self._ssl_context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._opened: list[DataPlaneClient] = []

    def __repr__(self) -> str:
        return f"Connection({self.url!r})"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, []
        for data_plane in opened:
            data_plane.close()
        self.client.close()

    def find_cache(self, name_or_id: str) -> Cache:
        """The tenant's cache with this id, or the live (pending, provisioning or ready) one with this name.

        Returns: the Cache.
        Raises: NotFoundError `cache_not_found` (its details list the live names); what kcaas.Client raises.
        """
        if _is_uuid(name_or_id):
            return self.client.get_cache(name_or_id)
        caches = self.client.list_caches()
        for cache in caches:
            if cache.name == name_or_id and cache.state in LIVE_STATES:
                return cache
        names = sorted({c.name for c in caches if c.state in LIVE_STATES})
        raise NotFoundError(
            f"no live cache named {name_or_id!r}",
            code="cache_not_found",
            details={"name": name_or_id, "live_caches": names},
            hint="attach it first (Connection.client.attach(name, spec, capacity)), or use one of live_caches",
        )

    def cache(
        self,
        name_or_id: str,
        *,
        access: str = "read",
        spec: KVCacheSpec | None = None,
        ready_timeout: float = 60.0,
        ttl_seconds: int | None = None,
        timeout: float = 30.0,
    ) -> DataPlaneClient:
        """A connected DataPlaneClient for the cache `name_or_id`. `access`: "read" (lookup and get: the default, as
        for the REST API's data tokens) or "readwrite" (also put and delete). `spec`: the engine's own KV identity,
        checked against the cache's (IdentityMismatch names the fields that differ); default the cache's.
        `ready_timeout` bounds the wait for `ready`; `timeout` is the data plane's per-operation timeout.

        Returns: the DataPlaneClient, connected (closed with this Connection).
        Raises: ValueError for an unknown `access`; NotFoundError as find_cache; WaitTimeoutError or CacheFailedError
            waiting for ready; IdentityMismatch when `spec` differs; KcaasError `certificate_verify_failed` when the
            node's certificate is not trusted; what kcaas.Client and DataPlaneClient.connect raise.
        """
        if access not in ACCESS_LEVELS:
            raise ValueError(f"access must be one of {ACCESS_LEVELS}, got {access!r}")
        cache = self.find_cache(name_or_id)
        if cache.state != "ready":
            cache = self.client.wait_for(cache.id, "ready", timeout=ready_timeout, current=cache)
        identity = cache.spec if spec is None else spec
        if identity is None:
            raise KcaasError(f"cache {cache.id} has no KV identity in its answer", code="invalid_spec")
        if cache.spec is not None:
            cache.spec.check_matches(identity)
        tokens = TokenSource(self.client, cache.id, access, ttl_seconds=ttl_seconds)
        host = cache.endpoint.rpartition(":")[0].strip("[]")
        data_plane = DataPlaneClient(
            cache.endpoint,
            tokens,
            cache.id,
            identity,
            ssl_context=self.ssl_context(),
            server_hostname="localhost" if host in _WILDCARD_HOSTS else None,
            timeout=timeout,
        )
        try:
            data_plane.connect()
        except KcaasError as error:
            data_plane.close()
            raise _certificate_error(error, cache.endpoint, self.url) or error from None
        with self._lock:
            self._opened.append(data_plane)
        return data_plane

    def ssl_context(self) -> ssl.SSLContext:
        """The data plane's TLS 1.3 context: trusting `ca=` when given, else the CA the control plane publishes."""
        with self._lock:
            if self._ssl_context is None:
                self._ssl_context = self._make_ssl_context()
            return self._ssl_context

    def _make_ssl_context(self) -> ssl.SSLContext:
        if not self._verify:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            return ctx
        if self._ca is not None:
            return tls.dataplane_ssl_context(_pem_of(self._ca))
        try:
            return tls.dataplane_ssl_context(tls.platform_ca_pem(self.url))
        except (OSError, ValueError) as exc:
            failure = APIConnectionError(
                f"could not fetch the platform CA from {self.url}{tls.CA_PATH}: {exc}",
                details={"url": self.url},
                hint=f"is the control plane running at {self.url} (`make up`)? Or pass ca= (a PEM file or text)",
            )
            raise _certificate_error(failure, self.url, self.url) or failure from None


def _pem_of(ca: str | os.PathLike) -> str:
    """PEM text given as-is, or read from the file `ca` names."""
    if isinstance(ca, str) and "-----BEGIN CERTIFICATE-----" in ca:
        return ca
    try:
        return Path(ca).read_text()
    except OSError as exc:
        raise KcaasError(f"cannot read the CA file {ca}: {exc}", code="invalid_ca") from None


def _certificate_error(error: KcaasError, where: str, url: str) -> CertificateVerifyError | None:
    """A CertificateVerifyError saying what to do, when `error` is a certificate the client does not trust."""
    if not is_certificate_failure(str(error.message)):
        return None
    return CertificateVerifyError(
        f"TLS to {where} failed: the certificate is not signed by a CA this client trusts ({error.message}). "
        f"Pass ca= (the PEM file of the CA that signs the nodes' certificates; `make up` writes "
        f"var/secrets/dev-ca.pem), or let kcaas.connect() fetch the platform CA from {url}{tls.CA_PATH}",
        details={"url": url} if where == url else {"endpoint": where},  # the control plane's, or a node's
    )


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(str(text))
    except ValueError:
        return False
    return True
