"""TLS for the SDK's data-plane connections when nodes serve certificates from the platform CA: fetch the CA
certificate the control plane publishes (`GET /.well-known/kcaas-ca.pem`, public) and build a TLS 1.3 client
context that trusts only it (hostname checked against the node certificate's endpoint SAN).

    ctx = kcaas.tls.platform_ssl_context("https://kcaas.example.com")
    DataPlaneClient(cache.endpoint, TokenSource(client, cache.id, "readwrite"), cache.id, spec, ssl_context=ctx)

kcaas.connect() does all of this itself (kcaas/connection.py).

Pin the CA out of band (a file shipped with the engine) where the control plane's own TLS is not trusted:
`dataplane_ssl_context(open("kcaas-ca.pem").read())`.
"""

from __future__ import annotations

import ssl
import urllib.request

CA_PATH = "/.well-known/kcaas-ca.pem"
MAX_CA_BYTES = 64 * 1024


def platform_ca_pem(base_url: str, *, timeout: float = 10.0, ssl_context: ssl.SSLContext | None = None) -> str:
    """The platform CA certificate (PEM) as the control plane at `base_url` publishes it."""
    with urllib.request.urlopen(base_url.rstrip("/") + CA_PATH, timeout=timeout, context=ssl_context) as response:
        pem = response.read(MAX_CA_BYTES + 1)
    if len(pem) > MAX_CA_BYTES or b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ValueError(f"{base_url}{CA_PATH} did not answer a PEM certificate")
    return pem.decode("ascii")


def dataplane_ssl_context(ca_pem: str) -> ssl.SSLContext:
    """TLS 1.3 only, trusting only `ca_pem`, hostname checked."""
    ctx = ssl.create_default_context(cadata=ca_pem)  # with cadata given, the system store is not loaded
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def platform_ssl_context(base_url: str, **fetch_options) -> ssl.SSLContext:
    return dataplane_ssl_context(platform_ca_pem(base_url, **fetch_options))
