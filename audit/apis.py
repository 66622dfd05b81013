"""REST API of the audit room: events (list), exports (streamed JSONL/CSV), digests, and the platform public key.

The audit room is a leaf: it imports no other room. Callers are told apart by duck typing on `request.user`: staff
(an authenticated user with `is_staff`) reads everything; a tenant key (a principal with `has_scope` and `tenant`)
holding `audit:read` reads only its own tenant's events and exports (naming another tenant is a 404, as everywhere);
without the scope it is a 403 `permission_denied` with `details.required_scope`; anyone else is refused.
Every export records an AUDIT_EXPORTED event (format, range, filter) in its own transaction before it streams.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from audit import api_examples, exports, queries
from audit.actions import AuditAction
from audit.context import ACTOR_KINDS
from audit.keys import platform_public_jwk
from core.errors import ApplicationError, NotFoundError

ACTOR_PATTERN = r"^(" + "|".join(ACTOR_KINDS) + r")(:[!-~]{1,200})?$"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "details"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "details": {"type": "object"}},
        }
    },
}
_ERROR_TEXT = {
    400: "Invalid request (validation_error with details.fields, invalid_range).",
    401: "Missing or refused credentials.",
    403: "Not allowed (permission_denied; details.required_scope `audit:read` for a key without it).",
    404: "Another tenant named by a tenant key (not_found).",
    429: "Rate limited (rate_limited).",
    503: "The audit trail could not record the export (audit_unavailable); nothing was exported.",
}


def _errors(*codes: int) -> dict:
    return {code: OpenApiResponse(response=_ERROR_SCHEMA, description=_ERROR_TEXT[code]) for code in codes}


# ---- who may read ----------------------------------------------------------------------------------------------------


def is_staff(user) -> bool:
    return bool(user is not None and getattr(user, "is_authenticated", False) and getattr(user, "is_staff", False))


def is_tenant_key(user) -> bool:
    return user is not None and hasattr(user, "has_scope") and hasattr(user, "tenant")


class AuditReadPermission(BasePermission):
    """Staff, or a tenant key holding audit:read (audit:write implies it)."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if is_staff(user):
            return True
        if not is_tenant_key(user):
            return False  # DRF answers 401 without credentials, 403 for other principals
        if user.has_scope("audit", "read"):
            return True
        raise ApplicationError(
            "This key lacks the audit:read scope.",
            code="permission_denied",
            status_code=403,
            details={"required_scope": "audit:read"},
        )


class StaffOnlyPermission(BasePermission):
    message = "Staff only."

    def has_permission(self, request, view) -> bool:
        return is_staff(request.user)


def tenant_scope(request, tenant_id):
    """The tenant the caller reads: a key's own (another one named is a 404); staff's filter (None: all)."""
    if is_staff(request.user):
        return tenant_id
    own = request.user.tenant.pk
    if tenant_id is not None and tenant_id != own:
        raise NotFoundError("No such tenant.")
    return own


# ---- query parameters ------------------------------------------------------------------------------------------------


class RangeSerializer(serializers.Serializer):
    """[from, to): RFC 3339 times; from before to."""

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = serializers.DateTimeField(required=False, help_text="Inclusive start (RFC 3339).")
        fields["to"] = serializers.DateTimeField(required=False, help_text="Exclusive end (RFC 3339).")
        return fields

    def validate(self, attrs):
        if "from" in attrs and "to" in attrs and attrs["from"] >= attrs["to"]:
            raise ApplicationError("`from` must be before `to`.", code="invalid_range")
        return attrs


def _validated(serializer_class, query_params) -> dict:
    serializer = serializer_class(data=query_params.dict())
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


_RANGE_PARAMS = [
    OpenApiParameter("from", OpenApiTypes.DATETIME, required=False, description="Inclusive start (RFC 3339)."),
    OpenApiParameter("to", OpenApiTypes.DATETIME, required=False, description="Exclusive end (RFC 3339)."),
]
_TENANT_PARAM = OpenApiParameter(
    "tenant_id",
    OpenApiTypes.UUID,
    required=False,
    description="Staff: confine to this tenant. A tenant key reads only its own (another tenant's id is a 404).",
)


# ---- events ----------------------------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="AuditEvent")
class AuditEventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    occurred_at = serializers.DateTimeField()
    actor_kind = serializers.ChoiceField(choices=ACTOR_KINDS)
    actor_id = serializers.CharField(allow_blank=True)
    tenant_id = serializers.UUIDField(allow_null=True)
    action = serializers.IntegerField(help_text="The action code (audit/actions.py).")
    action_name = serializers.SerializerMethodField()
    target_type = serializers.CharField()
    target_id = serializers.CharField(allow_blank=True)
    request_id = serializers.CharField(allow_blank=True)
    source_ip = serializers.IPAddressField(allow_null=True)
    old_values = serializers.JSONField(allow_null=True)
    new_values = serializers.JSONField(allow_null=True)
    prev_hash = serializers.CharField()
    hash = serializers.CharField()
    pseudonymised = serializers.SerializerMethodField(help_text="Personal fields replaced (erased tenant).")

    def get_action_name(self, event) -> str:
        try:
            return AuditAction(event.action).code_name
        except ValueError:
            return "unknown"

    def get_pseudonymised(self, event) -> bool:
        return event.pseudonymised_at is not None


class AuditEventListApi(APIView):
    permission_classes = [AuditReadPermission]
    pagination_class = api_settings.DEFAULT_PAGINATION_CLASS

    class FilterSerializer(RangeSerializer):
        tenant_id = serializers.UUIDField(required=False)
        actor = serializers.RegexField(ACTOR_PATTERN, required=False, max_length=210)
        action = serializers.ChoiceField(choices=[int(a) for a in AuditAction], required=False)

    @extend_schema(
        operation_id="audit_events_list",
        summary="List audit events",
        tags=["audit"],
        parameters=[
            *_RANGE_PARAMS,
            _TENANT_PARAM,
            OpenApiParameter(
                "actor",
                str,
                required=False,
                pattern=ACTOR_PATTERN,
                description="`kind` or `kind:id`, e.g. `key:<public id>`, `user:7`, `system`.",
            ),
            OpenApiParameter(
                "action", int, required=False, enum=[int(a) for a in AuditAction], description="An action code."
            ),
        ],
        responses={200: AuditEventSerializer(many=True), **_errors(400, 401, 403, 404, 429)},
        examples=[api_examples.EVENT_LIST, api_examples.INVALID_RANGE, api_examples.SCOPE_MISSING],
        description="One page of the audit trail in seq order, filtered by time range, tenant, actor and action: "
        "who did what to which resource, when, from where, with the values before and after, and each event's "
        "link in the hash chain. Staff (basic auth) read every tenant's events; a tenant key holding audit:read "
        "(or audit:write) reads its own tenant's only. Errors: 400 invalid_range (from not before to) or "
        "validation_error; 403 permission_denied with details.required_scope for a key without audit:read; 404 "
        "for another tenant's tenant_id named by a tenant key; 429 rate_limited.",
    )
    def get(self, request):
        filters = _validated(self.FilterSerializer, request.query_params)
        kind, _, actor_id = filters.get("actor", "").partition(":")
        events = queries.audit_event_list(
            start=filters.get("from"),
            end=filters.get("to"),
            tenant_id=tenant_scope(request, filters.get("tenant_id")),
            actor_kind=kind or None,
            actor_id=actor_id or None,
            action=filters.get("action"),
        )
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(events, request, view=self)
        return paginator.get_paginated_response(AuditEventSerializer(page, many=True).data)


# ---- exports ---------------------------------------------------------------------------------------------------------


class IgnoreFormatParameter(DefaultContentNegotiation):
    """`format` names the export's format here, not a DRF renderer: errors are always JSON."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class AuditExportApi(APIView):
    permission_classes = [AuditReadPermission]
    content_negotiation_class = IgnoreFormatParameter

    class FilterSerializer(RangeSerializer):
        format = serializers.ChoiceField(choices=list(exports.FORMATS), required=False, default="jsonl")
        tenant_id = serializers.UUIDField(required=False)

    @extend_schema(
        operation_id="audit_export",
        summary="Export a verifiable slice of the audit trail",
        tags=["audit"],
        parameters=[
            OpenApiParameter("format", str, required=False, enum=list(exports.FORMATS), default="jsonl"),
            *_RANGE_PARAMS,
            _TENANT_PARAM,
        ],
        responses={
            (200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.STR, description="JSONL export."),
            (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="CSV export."),
            **_errors(400, 401, 403, 404, 429, 503),
        },
        examples=[
            api_examples.AUDIT_EXPORT_JSONL,
            api_examples.AUDIT_EXPORT_CSV,
            api_examples.INVALID_RANGE,
            api_examples.SCOPE_MISSING,
        ],
        description="A verifiable export of [from, to) (default: everything until now), streamed as a file "
        "(JSONL or CSV): a header naming the range, filter and platform key, the events (witnesses for other "
        "tenants' events in a tenant export), the signed digests anchoring them, and a last record signing all "
        "of them. Verify offline with `python audit/chain.py verify FILE` (docs/compliance.md). Staff export "
        "everything (or one tenant_id); a tenant key holding audit:read exports its own tenant's events. Records "
        "an audit.exported event before it streams. Errors: 400 invalid_range or validation_error; 403 "
        "permission_denied for a key without audit:read; 404 for another tenant's tenant_id; 429 rate_limited; "
        "503 audit_unavailable when the export could not be recorded (nothing is exported then).",
    )
    def get(self, request):
        filters = _validated(self.FilterSerializer, request.query_params)
        download = exports.audit_export_begin(
            fmt=filters["format"],
            start=filters.get("from"),
            end=filters.get("to"),
            tenant_id=tenant_scope(request, filters.get("tenant_id")),
        )
        return exports.export_response(download)


# ---- digests ---------------------------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="AuditDigest")
class AuditDigestSerializer(serializers.Serializer):
    period_start = serializers.CharField(help_text="UTC, YYYY-MM-DDTHH:MM:SSZ (as signed).")
    period_end = serializers.CharField(help_text="UTC, YYYY-MM-DDTHH:MM:SSZ (as signed).")
    head_seq = serializers.IntegerField(help_text="The last event before period_end (0: none).")
    head_hash = serializers.CharField()
    prev_digest_hash = serializers.CharField()
    key_id = serializers.CharField(help_text="The platform key's RFC 7638 thumbprint.")
    digest_hash = serializers.CharField()
    signature = serializers.CharField(help_text="Ed25519 over the canonical digest body, base64url.")


class AuditDigestListApi(APIView):
    permission_classes = [StaffOnlyPermission]
    pagination_class = api_settings.DEFAULT_PAGINATION_CLASS

    @extend_schema(
        operation_id="audit_digests_list",
        summary="List the signed digests of the audit chain (staff)",
        tags=["audit"],
        parameters=_RANGE_PARAMS,
        responses={200: AuditDigestSerializer(many=True), **_errors(400, 401, 403, 429)},
        examples=[api_examples.DIGEST_LIST, api_examples.INVALID_RANGE],
        description="One page of the signed digests of the chain's head, one per period (hourly by default), "
        "oldest first: each names the last event before its period_end, chains to the previous digest and is "
        "signed with the platform key (/.well-known/kcaas-platform-key.json), so an export's events can be "
        "checked against them. Staff only (basic auth): a tenant key gets 403 permission_denied. Errors: 400 "
        "invalid_range (from not before to); 401 without credentials; 429 rate_limited.",
    )
    def get(self, request):
        filters = _validated(RangeSerializer, request.query_params)
        digests = queries.audit_digest_list(start=filters.get("from"), end=filters.get("to"))
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(digests, request, view=self)
        return paginator.get_paginated_response(AuditDigestSerializer([d.record() for d in page], many=True).data)


# ---- the platform key -----------------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="PlatformKey")
class PlatformKeySerializer(serializers.Serializer):
    kty = serializers.CharField()
    crv = serializers.CharField()
    x = serializers.CharField(help_text="The raw Ed25519 public key, base64url without padding.")
    kid = serializers.CharField(help_text="RFC 7638 thumbprint; the key_id of digests and receipts it signed.")
    use = serializers.CharField()
    alg = serializers.CharField()


class PlatformKeyApi(APIView):
    """The platform's public key (JWK): verifies audit digests and erasure receipts. Public, not rate limited."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema(
        operation_id="platform_key",
        summary="The platform's public signing key (JWK)",
        examples=[api_examples.PLATFORM_KEY],
        tags=["well-known"],
        auth=[],
        responses={200: PlatformKeySerializer},
    )
    def get(self, request):
        response = Response(PlatformKeySerializer(platform_public_jwk()).data)
        response["Cache-Control"] = "public, max-age=300"
        return response
