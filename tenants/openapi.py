"""The OpenAPI description of the tenants' API-key authentication (registered with drf-spectacular on import:
tenants.apps imports this module when the app is ready). The rooms' shared schema helpers are core.openapi."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Documents tenants.authentication.ApiKeyAuthentication as an HTTP bearer scheme (registered on import)."""

    target_class = "tenants.authentication.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(
            header_name="Authorization", token_prefix="Bearer", bearer_format="kc_live_<public_id>_<secret><crc>"
        )
