"""kcaas.Client's API keys: list, get, create, revoke and rotate (with overlap) the tenant's keys."""

from __future__ import annotations

from kcaas.client_transport import API_PREFIX, RestTransport, _segment
from kcaas.resources import ApiKeyInfo, IssuedKey


class KeyMethods(RestTransport):
    """/keys."""

    def list_keys(self) -> list[ApiKeyInfo]:
        """Every API key of this tenant (all pages; a key's secret is never shown again).

        Returns: the keys' descriptions.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (AuthenticationError 401,
            PermissionDeniedError 403), APIConnectionError when the control plane cannot be reached.
        """
        return [ApiKeyInfo.from_json(item) for item in self._paginate(f"{API_PREFIX}/keys")]

    def get_key(self, key_id: str) -> ApiKeyInfo:
        """One API key of this tenant, by id.

        Returns: the key's description.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (NotFoundError 404, AuthenticationError
            401), APIConnectionError when the control plane cannot be reached.
        """
        return ApiKeyInfo.from_json(self._request("GET", f"{API_PREFIX}/keys/{_segment(key_id)}").body)

    def create_key(
        self, scopes: list[str] | tuple[str, ...], name: str = "", expires_in_seconds: int | None = None
    ) -> IssuedKey:
        """A new API key with `scopes` (a subset of this key's), optionally named and expiring.

        Returns: the IssuedKey, whose `key` is the secret (shown this once).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (ValidationError 400 for an unknown scope,
            PermissionDeniedError 403 for one this key lacks, AuthenticationError 401), APIConnectionError when the
            control plane cannot be reached.
        """
        body = {"scopes": list(scopes), "name": name, "expires_in_seconds": expires_in_seconds}
        return IssuedKey.from_json(self._request("POST", f"{API_PREFIX}/keys", json_body=body).body)

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revoking is idempotent on the server (the first time is kept), so this request is retried.

        Returns: the key's description, revoked.
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (NotFoundError 404, AuthenticationError
            401), APIConnectionError when the control plane cannot be reached.
        """
        path = f"{API_PREFIX}/keys/{_segment(key_id)}/revoke"
        return ApiKeyInfo.from_json(self._request("POST", path, repeatable=True).body)

    def rotate_key(self, key_id: str, overlap_seconds: int | None = None) -> IssuedKey:
        """A successor key now; the old one keeps working for `overlap_seconds` (server default 1 h). If it is this
        client's own key, make a new Client with the successor's `key`.

        Returns: the successor IssuedKey (its secret shown this once).
        Raises: a kcaas.errors.KcaasError subclass carrying the API's code (NotFoundError 404, ConflictError 409 for a
            revoked, expired or rotated key, AuthenticationError 401), APIConnectionError when the control plane cannot
            be reached.
        """
        body = {} if overlap_seconds is None else {"overlap_seconds": int(overlap_seconds)}
        path = f"{API_PREFIX}/keys/{_segment(key_id)}/rotate"
        return IssuedKey.from_json(self._request("POST", path, json_body=body).body)
