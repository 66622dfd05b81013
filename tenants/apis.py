"""REST API of the tenants app: a tenant's API keys (scope ``keys``) and staff administration of tenants and quotas.

Each view validates its input, calls one service or selector, and serializes. Tenant isolation: a tenant key only
ever reaches its own tenant's rows (another tenant's key id is a 404, not a 403). The raw key appears only in the
responses of create and rotate; no response carries a secret or a hash.
"""

from __future__ import annotations

from datetime import timedelta

from django.core.validators import RegexValidator
from django.db import transaction
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ApplicationError
from core.openapi import AUTH_ERRORS, RATE_LIMIT_HEADERS, STAFF_TENANT_ID, RejectUnknownFieldsMixin, error_responses
from core.pagination import BoundedLimitOffsetPagination
from core.permissions import IsStaff, ScopePermission
from tenants import api_examples as ex
from tenants import scopes as scope_rules
from tenants import selectors, services
from tenants.fields import QuotaValueField, StrictCharField, StrictIntegerField
from tenants.models import Tenant
from tenants.principals import TenantPrincipal, request_tenant

DEFAULT_OVERLAP_SECONDS = 3600
MAX_KEY_LIFETIME_SECONDS = 5 * 366 * 24 * 3600


class JsonApi(APIView):
    """The base of this app's views: JSON request bodies only (the schema then lists exactly that)."""

    parser_classes = [JSONParser]


class PaginatedApi(JsonApi):
    """A view whose GET lists: LimitOffsetPagination at runtime and in the schema."""

    pagination_class = BoundedLimitOffsetPagination

    def paginated(self, queryset, serializer_class):
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(queryset, self.request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)


# ---- API keys ------------------------------------------------------------------------------------------------------


class KeyOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    tenant_id = serializers.UUIDField()
    name = serializers.CharField()
    public_id = serializers.CharField(help_text="The key's public handle; the key starts kc_live_<public_id>_.")
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=scope_rules.ALL_SCOPES))
    state = serializers.ChoiceField(choices=["active", "expired", "revoked"])
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    last_used_at = serializers.DateTimeField(allow_null=True, help_text="Updated by a periodic flush.")
    use_count = serializers.IntegerField(help_text="Updated by a periodic flush.")
    rotated_from = serializers.UUIDField(source="rotated_from_id", allow_null=True)


class IssuedKeyOutputSerializer(KeyOutputSerializer):
    key = serializers.CharField(help_text="The raw key. Shown only in this response: store it now.")


def _issued(issued: services.IssuedKey) -> dict:
    """The IssuedKeyOutputSerializer shape: the key's fields plus the raw key."""
    return {**KeyOutputSerializer(issued.api_key).data, "key": issued.raw_key}


_TENANT_ID_PARAM = STAFF_TENANT_ID
_KEY_TENANT_ID_PARAM = OpenApiParameter(
    "tenant_id",
    OpenApiTypes.UUID,
    required=False,
    description="Optional for staff: the key must belong to this tenant (else 404). A tenant key may leave it out; "
    "naming another tenant is a 404.",
)


@extend_schema_field(
    {
        "type": "string",
        "format": "uuid",
        "deprecated": True,
        "description": "Deprecated (accepted for one release): staff name the tenant with the query parameter "
        "`?tenant_id=`. Given both, they must agree (else 400 `tenant_id_conflict`).",
    }
)
class DeprecatedBodyTenantIdField(serializers.UUIDField):
    """The body's `tenant_id` of POST /keys, from before `?tenant_id=` was the one way: marked deprecated in the
    schema."""


class TenantQuerySerializer(serializers.Serializer):
    """`?tenant_id=`: how staff name the tenant of a tenant-scoped operation."""

    tenant_id = serializers.UUIDField(required=False)


def _query_tenant_id(request):
    """The `?tenant_id=` query parameter, validated (an empty value is a 400, not "absent"); None when not given."""
    query = TenantQuerySerializer(data=request.query_params.dict())
    query.is_valid(raise_exception=True)
    return query.validated_data.get("tenant_id")


def _named_tenant_id(request, body_tenant_id):
    """The tenant the caller names: `?tenant_id=`, or the deprecated body field `tenant_id` (kept for one release);
    both given and different is a 400 `tenant_id_conflict`. A tenant key naming another tenant either way is a 404
    first, as everywhere (so a key only ever learns that its own tenant exists)."""
    query_tenant_id = _query_tenant_id(request)
    if isinstance(request.user, TenantPrincipal):
        for named in (query_tenant_id, body_tenant_id):
            request_tenant(request, named)  # its own tenant (or none named), else 404
    if query_tenant_id is not None and body_tenant_id is not None and query_tenant_id != body_tenant_id:
        raise ApplicationError(
            "The query's tenant_id and the body's tenant_id differ: name the tenant once, as ?tenant_id=.",
            code="tenant_id_conflict",
            details={"query": str(query_tenant_id), "body": str(body_tenant_id)},
        )
    return query_tenant_id if query_tenant_id is not None else body_tenant_id


def _caller_scopes_cover(request, wanted) -> None:
    """A tenant key may not mint or rotate into scopes it does not hold itself (staff may)."""
    user = request.user
    if isinstance(user, TenantPrincipal) and not scope_rules.covers(user.scopes, wanted):
        missing = sorted(s for s in wanted if not scope_rules.covers(user.scopes, [s]))
        raise ApplicationError(
            "A key cannot grant scopes it does not hold.",
            code="permission_denied",
            status_code=403,
            details={"not_held": missing},
        )


class KeyListCreateApi(PaginatedApi):
    permission_classes = [ScopePermission]
    scope_resource = "keys"

    @extend_schema_serializer(component_name="KeyCreate")
    class InputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
        name = StrictCharField(
            max_length=100,
            required=False,
            allow_blank=True,
            default="",
            trim_whitespace=False,  # checked as sent, as the schema's pattern is
            validators=[RegexValidator(services.NAME_PATTERN, services.NAME_CHARACTERS_MESSAGE)],
        )
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=scope_rules.ALL_SCOPES),
            min_length=1,
            max_length=len(scope_rules.ALL_SCOPES),
        )
        expires_in_seconds = StrictIntegerField(
            required=False,
            allow_null=True,
            default=None,
            min_value=60,
            max_value=MAX_KEY_LIFETIME_SECONDS,
            help_text="Lifetime of the key; null or absent: it never expires (revoke or rotate it instead).",
        )
        tenant_id = DeprecatedBodyTenantIdField(required=False)

    @extend_schema(
        operation_id="keys_list",
        tags=["keys"],
        summary="List this tenant's API keys (never secrets or hashes)",
        examples=[ex.KEY_LIST],
        parameters=[_TENANT_ID_PARAM, *RATE_LIMIT_HEADERS],
        responses={200: KeyOutputSerializer(many=True), **error_responses(*AUTH_ERRORS, 404)},
        extensions={"x-codeSamples": ex.curl_samples("get", "/api/v1/keys")},
    )
    def get(self, request):
        """Newest first, paginated. Staff name the tenant with `?tenant_id=`; a tenant key sees only its own keys."""
        tenant = request_tenant(request, _query_tenant_id(request))
        return self.paginated(selectors.api_key_list(tenant=tenant), KeyOutputSerializer)

    @extend_schema(
        operation_id="keys_create",
        tags=["keys"],
        summary="Issue an API key; the raw key is in this response only",
        examples=[ex.KEY_CREATE, ex.KEY_ISSUED],
        request=InputSerializer,
        parameters=[_TENANT_ID_PARAM, *RATE_LIMIT_HEADERS],
        responses={201: IssuedKeyOutputSerializer, **error_responses(*AUTH_ERRORS, 404, 409)},
        extensions={"x-codeSamples": ex.curl_samples("post", "/api/v1/keys", ex.KEY_CREATE.value)},
    )
    def post(self, request):
        """Scopes are `<resource>:<action>`; a key may only grant scopes it holds. The raw key is returned once.
        Staff name the tenant with `?tenant_id=` (the body's `tenant_id` is deprecated; given both, they must
        agree, else 400 `tenant_id_conflict`)."""
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        tenant = request_tenant(request, _named_tenant_id(request, data.get("tenant_id")))
        _caller_scopes_cover(request, data["scopes"])
        lifetime = data["expires_in_seconds"]
        expires_at = timezone.now() + timedelta(seconds=lifetime) if lifetime is not None else None
        issued = services.api_key_issue(tenant=tenant, scopes=data["scopes"], name=data["name"], expires_at=expires_at)
        return Response(_issued(issued), status=status.HTTP_201_CREATED)


def _visible_key(request, key_id):
    """The key if this caller may see it: staff any (or, with `?tenant_id=`, only that tenant's), a tenant key only
    its tenant's (else 404)."""
    tenant_id = _query_tenant_id(request)
    named = isinstance(request.user, TenantPrincipal) or tenant_id is not None
    tenant = request_tenant(request, tenant_id) if named else None
    return selectors.api_key_get(key_id=key_id, tenant=tenant)


class KeyDetailApi(JsonApi):
    permission_classes = [ScopePermission]
    scope_resource = "keys"

    @extend_schema(
        operation_id="keys_retrieve",
        tags=["keys"],
        summary="One API key of this tenant",
        examples=[ex.KEY_ONE],
        parameters=[_KEY_TENANT_ID_PARAM, *RATE_LIMIT_HEADERS],
        responses={200: KeyOutputSerializer, **error_responses(*AUTH_ERRORS, 404)},
    )
    def get(self, request, key_id):
        """A key of the caller's tenant (another tenant's key id is a 404)."""
        return Response(KeyOutputSerializer(_visible_key(request, key_id)).data)


class KeyRevokeApi(JsonApi):
    permission_classes = [ScopePermission]
    scope_resource = "keys"

    @extend_schema(
        operation_id="keys_revoke",
        tags=["keys"],
        summary="Revoke an API key (irreversible)",
        examples=[ex.KEY_REVOKED],
        request=None,
        parameters=[_KEY_TENANT_ID_PARAM, *RATE_LIMIT_HEADERS],
        responses={200: KeyOutputSerializer, **error_responses(*AUTH_ERRORS, 404)},
        extensions={"x-codeSamples": ex.curl_samples("post", "/api/v1/keys/$KEY_ID/revoke")},
    )
    def post(self, request, key_id):
        """Revoked keys are refused from now on (401 `api_key_revoked`); revoking twice keeps the first time."""
        api_key = services.api_key_revoke(api_key=_visible_key(request, key_id))
        return Response(KeyOutputSerializer(api_key).data)


class KeyRotateApi(JsonApi):
    permission_classes = [ScopePermission]
    scope_resource = "keys"

    @extend_schema_serializer(component_name="KeyRotate")
    class InputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
        overlap_seconds = StrictIntegerField(
            min_value=0,
            max_value=services.MAX_OVERLAP_SECONDS,
            default=DEFAULT_OVERLAP_SECONDS,
            help_text="How long the old key keeps working (then it is refused as expired).",
        )

    @extend_schema(
        operation_id="keys_rotate",
        tags=["keys"],
        summary="Rotate an API key: a successor now, the old key expires after the overlap",
        examples=[ex.KEY_ROTATE, ex.KEY_SUCCESSOR],
        request=InputSerializer,
        parameters=[_KEY_TENANT_ID_PARAM, *RATE_LIMIT_HEADERS],
        responses={201: IssuedKeyOutputSerializer, **error_responses(*AUTH_ERRORS, 404, 409)},
    )
    def post(self, request, key_id):
        """The successor has the same scopes, name and expiry; the old key works for `overlap_seconds`, then 401."""
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        api_key = _visible_key(request, key_id)
        _caller_scopes_cover(request, api_key.scopes)
        issued = services.api_key_rotate(api_key=api_key, overlap_seconds=body.validated_data["overlap_seconds"])
        return Response(_issued(issued), status=status.HTTP_201_CREATED)


# ---- staff: tenants and quotas ---------------------------------------------------------------------------------------

STAFF_ERRORS = (400, 401, 403)


def _quota_field(field: str, **kwargs) -> serializers.IntegerField:
    low, high = services.QUOTA_BOUNDS[field]
    return StrictIntegerField(min_value=low, max_value=high, **kwargs)


def _quota_serializer(name: str, doc: str, base=serializers.Serializer, make_field=_quota_field, **field_kwargs):
    """A serializer class with one bounded field per quota limit."""
    attrs = {field: make_field(field, **field_kwargs) for field in services.QUOTA_BOUNDS}
    return type(name, (base,), {**attrs, "__doc__": doc, "__module__": __name__})


QuotaOverridesSerializer = _quota_serializer(
    "QuotaOverridesSerializer", "Per-tenant overrides; null means the default.", allow_null=True
)


class _QuotaOutputBase(serializers.Serializer):
    tenant_id = serializers.UUIDField()
    overrides = QuotaOverridesSerializer()


QuotaOutputSerializer = _quota_serializer("QuotaOutputSerializer", "Effective limits.", base=_QuotaOutputBase)


class _QuotaPatchBase(RejectUnknownFieldsMixin, serializers.Serializer):
    pass


def _quota_input_field(field: str, **kwargs) -> QuotaValueField:
    return QuotaValueField(quota_field=field, bounds=services.QUOTA_BOUNDS[field], **kwargs)


QuotaPatchSerializer = _quota_serializer(
    "QuotaPatchSerializer",
    "Any subset of the limits; null resets one to the default. A limit is an integer, or a string: a whole number, "
    'and for the byte limits optionally a binary unit ("1GiB", "512 MiB"), the same values the console takes. '
    "Unknown fields are refused.",
    base=_QuotaPatchBase,
    make_field=_quota_input_field,
    required=False,
    allow_null=True,
)


class TenantOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    status = serializers.ChoiceField(choices=Tenant.Status.choices)
    created_at = serializers.DateTimeField()


class TenantListCreateApi(PaginatedApi):
    permission_classes = [IsStaff]

    @extend_schema_serializer(component_name="TenantCreate")
    class InputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
        name = StrictCharField(
            max_length=services.TENANT_NAME_MAX_LENGTH,
            trim_whitespace=False,  # checked as sent, as the schema's pattern is: "\rname" is refused, not trimmed
            validators=[
                RegexValidator(services.NONBLANK_NAME_PATTERN, "Not blank. " + services.NAME_CHARACTERS_MESSAGE)
            ],
        )
        quota = QuotaPatchSerializer(
            required=False,
            help_text="Initial quota overrides, as PATCH .../quota takes them; set with the tenant, or nothing is "
            "created.",
        )

    @extend_schema(
        operation_id="admin_tenants_list",
        tags=["admin"],
        summary="List tenants (staff)",
        examples=[ex.TENANT_LIST],
        responses={200: TenantOutputSerializer(many=True), **error_responses(*STAFF_ERRORS)},
    )
    def get(self, request):
        """All tenants (id, name, status, created_at), oldest first, paginated with limit/offset. Staff only: a
        tenant key is refused with 403."""
        return self.paginated(selectors.tenant_list(), TenantOutputSerializer)

    @extend_schema(
        operation_id="admin_tenants_create",
        tags=["admin"],
        summary="Create a tenant (staff)",
        examples=[ex.TENANT_CREATE, ex.TENANT_CREATED],
        request=InputSerializer,
        responses={201: TenantOutputSerializer, **error_responses(*STAFF_ERRORS, 409)},
    )
    def post(self, request):
        """A new active tenant with default quotas, or the `quota` overrides given (in the same transaction: a refused
        value creates nothing); names are unique (409 `tenant_name_taken`)."""
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        with transaction.atomic():
            tenant = services.tenant_create(name=body.validated_data["name"])
            quota = body.validated_data.get("quota")
            if quota:
                services.quota_update(tenant=tenant, **quota)
        return Response(TenantOutputSerializer(tenant).data, status=status.HTTP_201_CREATED)


class TenantDetailApi(JsonApi):
    permission_classes = [IsStaff]

    @extend_schema_serializer(component_name="TenantStatusUpdate")
    class InputSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=[Tenant.Status.ACTIVE, Tenant.Status.SUSPENDED], required=False)

    @extend_schema(
        operation_id="admin_tenants_retrieve",
        tags=["admin"],
        summary="One tenant (staff)",
        examples=[ex.TENANT_ONE],
        responses={200: TenantOutputSerializer, **error_responses(*STAFF_ERRORS, 404)},
    )
    def get(self, request, tenant_id):
        """One tenant by id: its name, status (active or suspended) and creation time; 404 for an unknown id. Its
        quota is at .../quota, its erasure and export under the privacy operations."""
        return Response(TenantOutputSerializer(selectors.tenant_get(tenant_id=tenant_id)).data)

    @extend_schema(
        operation_id="admin_tenants_update_status",
        tags=["admin"],
        summary="Suspend or reactivate a tenant (staff)",
        examples=[ex.TENANT_SUSPEND, ex.TENANT_SUSPENDED],
        request=InputSerializer,
        responses={200: TenantOutputSerializer, **error_responses(*STAFF_ERRORS, 404, 409)},
    )
    def patch(self, request, tenant_id):
        """Set `status` to `suspended` (its keys are refused with 401 `tenant_inactive`) or back to `active`."""
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant = selectors.tenant_get(tenant_id=tenant_id)
        if "status" in body.validated_data:  # PATCH semantics: an empty body changes nothing
            tenant = services.tenant_set_status(tenant=tenant, status=body.validated_data["status"])
        return Response(TenantOutputSerializer(tenant).data)


def _quota_data(tenant: Tenant) -> dict:
    limits = selectors.quota_limits(tenant=tenant)
    return {
        "tenant_id": tenant.pk,
        **{field: getattr(limits, field) for field in services.QUOTA_BOUNDS},
        "overrides": selectors.quota_overrides(tenant=tenant),
    }


class TenantQuotaApi(JsonApi):
    permission_classes = [IsStaff]

    @extend_schema(
        operation_id="admin_tenants_quota_retrieve",
        tags=["admin"],
        summary="A tenant's effective quota and overrides (staff)",
        examples=[ex.QUOTA_DEFAULTS],
        responses={200: QuotaOutputSerializer, **error_responses(*STAFF_ERRORS, 404)},
    )
    def get(self, request, tenant_id):
        """Effective limits (overrides merged over the defaults) and the overrides themselves."""
        tenant = selectors.tenant_get(tenant_id=tenant_id)
        return Response(QuotaOutputSerializer(_quota_data(tenant)).data)

    @extend_schema(
        operation_id="admin_tenants_quota_update",
        tags=["admin"],
        summary="Override quota limits; null resets to the default (staff)",
        examples=[ex.QUOTA_PATCH, ex.QUOTA_PATCHED],
        request=QuotaPatchSerializer,
        responses={200: QuotaOutputSerializer, **error_responses(*STAFF_ERRORS, 404)},
    )
    def patch(self, request, tenant_id):
        """Integers or unit strings ("1GiB") within the documented bounds, or null for the default; unknown fields
        are a 400. A limit below what the tenant uses now is accepted: nothing is taken away, new attaches are
        refused, and GET /api/v1/usage flags it (`over_quota`)."""
        body = QuotaPatchSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant = selectors.tenant_get(tenant_id=tenant_id)
        services.quota_update(tenant=tenant, **body.validated_data)
        tenant = selectors.tenant_get(tenant_id=tenant_id)
        return Response(QuotaOutputSerializer(_quota_data(tenant)).data)


# ---- who am I --------------------------------------------------------------------------------------------------------


class WhoAmIOutputSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["tenant_key", "staff"])
    tenant_id = serializers.UUIDField(allow_null=True)
    key_id = serializers.UUIDField(allow_null=True)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=scope_rules.ALL_SCOPES))


class WhoAmIApi(JsonApi):
    """The caller as the control plane sees it: lets an SDK check a key (and its scopes) in one cheap request."""

    @extend_schema(
        operation_id="whoami",
        tags=["keys"],
        summary="Who the caller is: its tenant, key and scopes",
        examples=[ex.WHOAMI],
        description="Answers for any valid credential: a tenant key gets its tenant id, key id and scopes (so an SDK "
        "can check a key in one cheap request); staff get kind `staff`. 401 for a missing, malformed, revoked or "
        "expired key.",
        responses={200: WhoAmIOutputSerializer, **error_responses(*AUTH_ERRORS)},
    )
    def get(self, request):
        user = request.user
        if isinstance(user, TenantPrincipal):
            data = {
                "kind": "tenant_key",
                "tenant_id": user.tenant.id,
                "key_id": user.api_key.id,
                "scopes": sorted(user.scopes),
            }
        elif getattr(user, "is_staff", False):
            data = {"kind": "staff", "tenant_id": None, "key_id": None, "scopes": []}
        else:
            raise ApplicationError("This account has no role in the API.", code="permission_denied", status_code=403)
        return Response(WhoAmIOutputSerializer(data).data)
