"""DRF authentication with tenant API keys: ``Authorization: Bearer kc_live_<public_id>_<secret><crc>``.

Order of checks, and what each refusal reveals (all 401, one error shape):
1. shape + CRC, offline                         -> ``malformed_api_key``
2. lookup by public id + constant-time compare  -> ``invalid_api_key`` for an unknown id AND for a wrong secret:
   the same code, message and work (an unknown id is compared against a dummy hash), so a caller cannot probe
   which public ids exist. The distinction is logged server-side only.
3. only for the holder of the right secret: ``api_key_revoked``, ``api_key_expired``, ``tenant_inactive``.
A Bearer token with another well-formed prefix (``kc_node_...``) is not ours: we return None so the next
authenticator (or a 401 ``not_authenticated``) answers.

On success ``request.user`` is a TenantPrincipal and ``request.auth`` the ApiKey; the use is counted in Redis
(tenants.usage), not in the database.
"""

from __future__ import annotations

import logging

from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from core import keys
from core.errors import ApplicationError
from tenants import usage
from tenants.principals import TenantPrincipal
from tenants.selectors import api_key_for_authentication

logger = logging.getLogger("kcaas.tenants.auth")

WWW_AUTHENTICATE = 'Bearer realm="kcaas"'


class ApiKeyAuthError(ApplicationError, exceptions.AuthenticationFailed):
    """A refused key: 401 with its own code. Also an AuthenticationFailed, so DRF treats it as one."""

    status_code = 401
    code = "authentication_failed"

    def __init__(self, message: str, *, code: str, details: dict | None = None):
        super().__init__(message, code=code, details=details)
        self.headers = {"WWW-Authenticate": f'{WWW_AUTHENTICATE}, error="invalid_token"'}


def _malformed() -> ApiKeyAuthError:
    return ApiKeyAuthError("The API key is malformed.", code="malformed_api_key")


def _invalid() -> ApiKeyAuthError:
    return ApiKeyAuthError("The API key is not valid.", code="invalid_api_key")


class ApiKeyAuthentication(BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request):
        raw = self._bearer_token(request)
        if raw is None:
            return None
        try:
            prefix, public_id, secret = keys.parse_key(raw)
        except keys.InvalidKeyFormat:
            raise _malformed() from None
        if prefix != keys.TENANT_KEY_PREFIX:
            return None
        api_key = api_key_for_authentication(public_id=public_id)
        if not keys.verify_secret(secret, api_key.secret_hash if api_key is not None else None):
            logger.info("refused key %s: %s", public_id, "unknown public id" if api_key is None else "wrong secret")
            raise _invalid()
        self._check_usable(api_key)
        usage.record_key_use(api_key.pk)
        principal = TenantPrincipal(tenant=api_key.tenant, api_key=api_key, scopes=frozenset(api_key.scopes))
        return principal, api_key

    def _bearer_token(self, request) -> str | None:
        """The token of a Bearer header; None when there is no such header (another scheme is not ours)."""
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise _malformed()
        try:
            return parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise _malformed() from None

    @staticmethod
    def _check_usable(api_key) -> None:
        now = timezone.now()
        if api_key.revoked_at is not None:
            raise ApiKeyAuthError("The API key was revoked.", code="api_key_revoked")
        if api_key.expires_at is not None and api_key.expires_at <= now:
            raise ApiKeyAuthError("The API key has expired.", code="api_key_expired")
        if not api_key.tenant.is_active:
            raise ApiKeyAuthError(
                f"The tenant is {api_key.tenant.status}.",
                code="tenant_inactive",
                details={"status": api_key.tenant.status},
            )

    def authenticate_header(self, request) -> str:
        return WWW_AUTHENTICATE
