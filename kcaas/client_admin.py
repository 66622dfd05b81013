"""The platform administrator's client: tenants, their quotas and their API keys over the staff REST API.

    import kcaas
    admin = kcaas.admin()                       # KCAAS_URL, KCAAS_ADMIN_USER (default admin), KCAAS_ADMIN_PASSWORD
    acme = admin.create_tenant("acme", max_device_bytes=8 << 30)
    issued = admin.create_key("acme", ["caches:write", "usage:read"], name="onboarding")
    issued.key                                  # the tenant's secret, shown this once
    admin.set_quota("acme", max_device_bytes="16GiB")
    admin.suspend("acme"); admin.reactivate("acme")

Authentication: HTTP Basic as a platform administrator (staff without a console role; platform/controlplane/
authentication.py). `make up` creates `admin`, prints its password on its banner (`admin login admin / ...`) and
writes it to var/secrets/admin-password.

Tenants are named by name or id wherever one is taken (`tenant`). Tenant-scoped calls (the keys) name the tenant as
the query parameter `?tenant_id=`, the one way staff name a tenant on the API.

Errors: the SDK's typed kcaas.errors.KcaasError subclasses (the transport's, kcaas/client_transport.py), with hints
for an administrator: a refused password names KCAAS_ADMIN_PASSWORD, an unknown tenant `kcaas admin tenants ls`.
Retries: reads, quota and status changes (PATCH: setting a value twice is setting it once) and revocation are
retried as the tenant client's are; creating a tenant or a key is never repeated after a lost answer.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kcaas.client_transport import API_PREFIX, RestTransport, _segment
from kcaas.connection import DEFAULT_URL
from kcaas.errors import KcaasError, NotFoundError
from kcaas.resources import ApiKeyInfo, IssuedKey, _parse_time

DEFAULT_ADMIN_USER = "admin"  # the administrator `make up` creates
# The API's quota limits (PATCH /admin/tenants/{id}/quota); byte limits also take unit strings ("8GiB").
QUOTA_LIMITS = (
    "max_caches",
    "max_device_bytes",
    "max_dram_bytes",
    "max_ssd_bytes",
    "max_network_bytes",
    "max_requests_per_second",
    "max_data_tokens_outstanding",
    "max_api_keys",
)
ALL_SCOPES = tuple(f"{r}:{a}" for r in ("caches", "keys", "usage", "audit") for a in ("read", "write"))
PASSWORD_HINT = (
    "set KCAAS_ADMIN_PASSWORD (and KCAAS_ADMIN_USER, default admin) to a platform administrator's password: `make up` "
    "prints it on its banner (`admin login admin / PASSWORD`, and an `operator shell: export ...` line) and writes it "
    "to var/secrets/admin-password"
)
_TENANTS = f"{API_PREFIX}/admin/tenants"
_FULL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class TenantQuota:
    """A tenant's quota (GET /admin/tenants/{id}/quota): the effective limits and the overrides behind them."""

    tenant_id: str
    limits: dict[str, int] = field(default_factory=dict)  # limit -> its effective value (override, else default)
    overrides: dict[str, int | None] = field(default_factory=dict)  # limit -> the override; None: the default

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TenantQuota:
        limits = {name: int(data[name]) for name in QUOTA_LIMITS if data.get(name) is not None}
        return cls(tenant_id=str(data["tenant_id"]), limits=limits, overrides=dict(data.get("overrides") or {}))


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """A tenant (GET /admin/tenants/{id}); `quota` when it was asked for."""

    id: str
    name: str
    status: str  # active | suspended
    created_at: datetime | None = None
    quota: TenantQuota | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], quota: TenantQuota | None = None) -> Tenant:
        return cls(
            id=str(data["id"]),
            name=str(data["name"]),
            status=str(data["status"]),
            created_at=_parse_time(data.get("created_at")),
            quota=quota,
        )


def admin_auth_hint(error: KcaasError) -> str | None:
    """What an administrator should do about `error`, where it differs from a tenant's advice."""
    if error.status == 401:
        return "the admin credentials were refused: " + PASSWORD_HINT
    if error.status == 403 and error.code == "permission_denied":
        return "this account is no platform administrator (staff without a console role): use one that is"
    if error.code == "tenant_name_taken":
        return "pick another name, or look at the existing tenant: kcaas admin tenants show NAME"
    if error.code == "tenant_name_confusable":
        return "the name looks like another tenant's: pick a clearly different one (kcaas admin tenants ls)"
    if error.status == 404 or error.code == "not_found":
        return "`kcaas admin tenants ls` lists the tenants (by name and id), `kcaas admin keys ls --tenant T` the keys"
    return None


class AdminClient(RestTransport):
    """A platform administrator's handle on the staff REST API (HTTP Basic). Thread-safe, as kcaas.Client is.

    The transport's retries, timeouts and typed errors are kcaas.Client's (kcaas/client_transport.py); only the
    credential differs: Basic `user:password` instead of a Bearer key, kept out of every error and repr."""

    def __init__(self, base_url: str, user: str, password: str, **options: Any) -> None:
        if not password:
            raise KcaasError(
                "no admin password: pass password= or set KCAAS_ADMIN_PASSWORD",
                code="not_authenticated",
                details={"url": base_url},
                hint=PASSWORD_HINT,
            )
        super().__init__(base_url, password, **options)  # the password as the transport's secret: scrubbed from errors
        self.user = user
        self.__authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def __repr__(self) -> str:
        return f"AdminClient(base_url={self.base_url!r}, user={self.user!r})"

    def _send_once(self, method: str, target: str, body: bytes | None, headers: dict[str, str]):
        return super()._send_once(method, target, body, {**headers, "Authorization": self.__authorization})

    def _error(self, response) -> KcaasError:
        error = super()._error(response)
        error.hint = admin_auth_hint(error) or error.hint
        return error

    # -- tenants --------------------------------------------------------------------------------------------------

    def list_tenants(self) -> list[Tenant]:
        """Every tenant, oldest first (all pages).

        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (AuthenticationError 401 for refused
            credentials, PermissionDeniedError 403 for a non-staff account), APIConnectionError when the control
            plane cannot be reached.
        """
        return [Tenant.from_json(item) for item in self._paginate(_TENANTS)]

    def get_tenant(self, tenant: str, *, quota: bool = True) -> Tenant:
        """One tenant by name or id, with its quota (unless quota=False).

        Raises: NotFoundError `not_found` for no such tenant, and what list_tenants raises.
        """
        found = self._find(tenant)
        return Tenant.from_json(found, self.get_quota(found["id"]) if quota else None)

    def tenant_id(self, tenant: str) -> str:
        """The id of the tenant named `tenant` (a name or an id). Raises NotFoundError when there is none."""
        return str(self._find(tenant)["id"])

    def create_tenant(self, name: str, **limits: int | str | None) -> Tenant:
        """A new active tenant, with quota overrides `limits` (QUOTA_LIMITS; byte limits as ints or "8GiB") set in
        the same transaction: a refused value creates nothing. Not retried after a lost answer.

        Returns: the Tenant with its quota.
        Raises: ConflictError 409 `tenant_name_taken` / `tenant_name_confusable`, ValidationError 400 for a bad name
            or limit (details.fields), and what list_tenants raises.
        """
        body: dict[str, Any] = {"name": name}
        if limits:
            body["quota"] = dict(limits)
        created = self._request("POST", _TENANTS, json_body=body).body
        return Tenant.from_json(created, self.get_quota(created["id"]))

    def get_quota(self, tenant: str) -> TenantQuota:
        """A tenant's effective limits and overrides (tenant: name or id)."""
        return TenantQuota.from_json(self._request("GET", f"{self._tenant_path(tenant)}/quota").body)

    def set_quota(self, tenant: str, **limits: int | str | None) -> TenantQuota:
        """Override quota limits (QUOTA_LIMITS; byte limits as ints or "8GiB"); None resets one to the default.
        Limits not given are unchanged.

        Raises: ValidationError 400 for an unknown limit or a value out of bounds (details.fields), NotFoundError.
        """
        path = f"{self._tenant_path(tenant)}/quota"
        return TenantQuota.from_json(self._request("PATCH", path, json_body=dict(limits), repeatable=True).body)

    def suspend(self, tenant: str) -> Tenant:
        """Suspend a tenant: its keys are refused (401 `tenant_inactive`) until it is reactivated."""
        return self._set_status(tenant, "suspended")

    def reactivate(self, tenant: str) -> Tenant:
        """Make a suspended tenant active again."""
        return self._set_status(tenant, "active")

    def _set_status(self, tenant: str, status: str) -> Tenant:
        path = self._tenant_path(tenant)
        return Tenant.from_json(self._request("PATCH", path, json_body={"status": status}, repeatable=True).body)

    # -- a tenant's API keys --------------------------------------------------------------------------------------

    def create_key(
        self,
        tenant: str,
        scopes: list[str] | tuple[str, ...] = ALL_SCOPES,
        *,
        name: str = "",
        expires_in_seconds: int | None = None,
    ) -> IssuedKey:
        """A new API key for `tenant` (name or id) with `scopes` (default: every scope). Not retried after a lost
        answer.

        Returns: the IssuedKey, whose `key` is the secret (shown this once).
        Raises: ValidationError 400 (an unknown scope), QuotaExceededError (the tenant's max_api_keys),
            NotFoundError, and what list_tenants raises.
        """
        body = {"scopes": list(scopes), "name": name, "expires_in_seconds": expires_in_seconds}
        query = {"tenant_id": self.tenant_id(tenant)}
        return IssuedKey.from_json(self._request("POST", f"{API_PREFIX}/keys", json_body=body, query=query).body)

    def list_keys(self, tenant: str) -> list[ApiKeyInfo]:
        """Every API key of `tenant`, newest first (never a secret)."""
        query = {"tenant_id": self.tenant_id(tenant)}
        return [ApiKeyInfo.from_json(item) for item in self._paginate(f"{API_PREFIX}/keys", query)]

    def revoke_key(self, tenant: str, key_id: str) -> ApiKeyInfo:
        """Revoke `tenant`'s key `key_id` now (idempotent; retried). Another tenant's key is a NotFoundError."""
        query = {"tenant_id": self.tenant_id(tenant)}
        path = f"{API_PREFIX}/keys/{_segment(key_id)}/revoke"
        return ApiKeyInfo.from_json(self._request("POST", path, query=query, repeatable=True).body)

    # -- naming ---------------------------------------------------------------------------------------------------

    def _tenant_path(self, tenant: str) -> str:
        return f"{_TENANTS}/{_segment(self.tenant_id(tenant))}"

    def _find(self, reference: str) -> Mapping[str, Any]:
        """The tenant named `reference`: by id (a full id), else by its exact name, else by a name equal but for
        case; NotFoundError when none is."""
        if _FULL_ID.fullmatch(reference):
            try:
                return self._request("GET", f"{_TENANTS}/{_segment(reference)}").body
            except NotFoundError:
                pass  # a tenant may be named like an id
        every = list(self._paginate(_TENANTS))
        named = [t for t in every if t.get("name") == reference]
        named = named or [t for t in every if str(t.get("name", "")).casefold() == reference.casefold()]
        if len(named) == 1:
            return named[0]
        raise NotFoundError(
            f"No tenant is named {reference!r} or has that id.",
            code="not_found",
            details={"tenant": reference},
            hint="`kcaas admin tenants ls` lists the tenants (by name and id)",
        )


def admin(url: str | None = None, user: str | None = None, password: str | None = None, **options: Any) -> AdminClient:
    """An AdminClient for the control plane at `url` (default $KCAAS_URL, else http://127.0.0.1:8000) as `user`
    (default $KCAAS_ADMIN_USER, else admin) with `password` (default $KCAAS_ADMIN_PASSWORD). `options` go to the
    transport (timeout, retries, retry_budget, ssl_context).

    Raises: KcaasError `not_authenticated` when no password is given or set (its hint says where `make up` prints
        it); ValueError for a URL that is not http(s).
    """
    url = url or os.environ.get("KCAAS_URL") or DEFAULT_URL
    user = user or os.environ.get("KCAAS_ADMIN_USER", "").strip() or DEFAULT_ADMIN_USER
    password = password or os.environ.get("KCAAS_ADMIN_PASSWORD", "").strip()
    return AdminClient(url, user, password or "", **options)
