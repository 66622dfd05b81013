"""OpenAPI helpers shared by the control-plane rooms: the one error shape, the standard refusals, and input
serializers that refuse undeclared fields (and say so in the schema).

``error_responses(400, 401, ...)`` gives drf-spectacular response entries for the error body
``{"error": {"code", "message", "details"}}``; ``RATE_LIMIT_HEADERS`` documents the 429 headers of TenantRateThrottle.
"""

from __future__ import annotations

from collections.abc import Mapping

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import serializers


class RejectUnknownFieldsMixin:
    """For input serializers: a field the serializer does not declare is a 400, not silently ignored (a typo in a
    quota override must not look like success). The schema says ``additionalProperties: false`` to match. Checked
    on the data the serializer is given, so it holds for a nested serializer too (an attach's ``spec``)."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({str(name): ["Unknown field."] for name in unknown})
        return super().to_internal_value(data)


class RejectUnknownFieldsExtension(OpenApiSerializerExtension):
    target_class = RejectUnknownFieldsMixin
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        schema["additionalProperties"] = False
        return schema


class ErrorBodySerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable machine-readable code, e.g. `invalid_api_key`, `rate_limited`.")
    message = serializers.CharField()
    details = serializers.DictField(help_text="Code-specific details; `fields` for validation errors.")


class ErrorResponseSerializer(serializers.Serializer):
    error = ErrorBodySerializer()


_DESCRIPTIONS = {
    400: "Invalid request (validation_error with details.fields, malformed_request, tenant_required).",
    401: "Missing or refused credentials (not_authenticated, malformed_api_key, invalid_api_key, api_key_revoked, "
    "api_key_expired, tenant_inactive).",
    403: "Authenticated but not allowed (permission_denied with details.required_scope).",
    404: "No such resource, or not visible to this caller (not_found).",
    409: "Conflicts with the current state (e.g. tenant_name_taken, api_key_inactive).",
    422: "Well-formed but unprocessable.",
    429: "Tenant rate limit exceeded (rate_limited); see Retry-After and RateLimit-* headers.",
    503: "Temporarily unavailable.",
}


def error_responses(*status_codes: int) -> dict[int, OpenApiResponse]:
    return {
        code: OpenApiResponse(response=ErrorResponseSerializer, description=_DESCRIPTIONS.get(code, "Error."))
        for code in status_codes
    }


# Errors every tenant-authenticated endpoint can return, on top of its own.
AUTH_ERRORS = (400, 401, 403, 429)

STAFF_TENANT_ID = OpenApiParameter(
    "tenant_id",
    OpenApiTypes.UUID,
    required=False,
    description="Staff only (required for staff): the tenant, as a query parameter, the way staff name the tenant on "
    "every tenant-scoped operation. A tenant key may leave it out; naming another tenant is a 404.",
)

RATE_LIMIT_HEADERS = [
    OpenApiParameter(name, OpenApiTypes.INT, location=OpenApiParameter.HEADER, response=[429], description=text)
    for name, text in (
        ("Retry-After", "Seconds until a request would be allowed."),
        ("RateLimit-Limit", "Requests allowed in a burst."),
        ("RateLimit-Remaining", "Requests left now (0 on a 429)."),
        ("RateLimit-Reset", "Seconds until the burst allowance is whole again."),
    )
]
