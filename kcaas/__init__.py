"""KCaaS tenant SDK: `kcaas.connect()` (kcaas.connection: URL + API key -> a ready data-plane client per cache), the
REST client (kcaas.Client) and its response models (kcaas.resources: kcaas.Cache, ...),
data-token refresh (kcaas.TokenSource), the shared cache identity (kcaas.spec) and engine connectors. The data-plane
client is kcaas.DataPlaneClient (kcaas.dataplane). For platform administrators: `kcaas.admin()`
(kcaas.client_admin: tenants, their quotas and API keys)."""

# Exported lazily (PEP 562): `import kcaas.spec` / `kcaas.wire` (the control plane, the node agent) stays free of the
# REST client's imports (http.client, ssl) until someone asks for kcaas.Client.
_EXPORTS = {
    "admin": "kcaas.client_admin",
    "AdminClient": "kcaas.client_admin",
    "ApiKeyInfo": "kcaas.resources",
    "Cache": "kcaas.resources",
    "CertificateVerifyError": "kcaas.connection",
    "Connection": "kcaas.connection",
    "connect": "kcaas.connection",
    "Client": "kcaas.client",
    "DataPlaneClient": "kcaas.dataplane",
    "DataPlaneError": "kcaas.dataplane",
    "DataToken": "kcaas.resources",
    "IssuedKey": "kcaas.resources",
    "Principal": "kcaas.resources",
    "TokenSource": "kcaas.tokens",
    "Usage": "kcaas.usage",
    "__version__": "kcaas.client",
    "KcaasError": "kcaas.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kcaas' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
