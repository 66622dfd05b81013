"""REST API of the caches room: attach, list, get, detach (scope `caches`), data tokens, and the JWKS (the tenant's
usage moved to billing.apis).

Each view validates, calls one service or selector, and serializes. Tenant isolation: a tenant key reaches only its
own tenant's caches; another tenant's cache id (guessed, listed or forged) is a 404, never a 403. Staff users see
every tenant's caches (optionally one, with `tenant_id`) and attach for a named tenant; they get no data tokens.
"""

import uuid
from typing import Literal

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny, BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from caches import api_examples as ex
from caches import selectors, services, signing
from caches.errors import InvalidCapacity, InvalidSpec
from caches.idempotency import HEADER as IDEMPOTENCY_HEADER
from caches.idempotency import KEY_PATTERN, REPLAYED_HEADER, idempotent
from caches.models import CacheState
from caches.selectors import cache_resident_bytes_reported, caches_contents
from core.errors import ApplicationError
from core.openapi import AUTH_ERRORS, RATE_LIMIT_HEADERS, RejectUnknownFieldsMixin, error_responses
from core.pagination import BoundedLimitOffsetPagination
from core.permissions import ScopePermission
from kcaas.spec import (
    ATTENTION_KINDS,
    KV_DTYPES,
    MAX_BLOCK_SIZE,
    MAX_FINGERPRINT_LEN,
    STORAGE_DTYPES,
    KVCacheSpec,
    SpecError,
    latent_head_shape,
)
from tenants.fields import StrictBooleanField, StrictIntegerField
from tenants.principals import TenantPrincipal, is_staff_user, request_tenant

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_SHAPE = 1 << 16  # layers, heads, head_dim: far above any model, small enough that byte sizes stay exact


# ---- serializers shared by the operations ---------------------------------------------------------------------------


class SpecSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    """The cache's KV identity/layout (kcaas.spec.KVCacheSpec). An 'mla' spec may leave num_kv_heads and head_dim
    out: they follow from its latent width (1 and (kv_lora_rank + qk_rope_head_dim) / 2)."""

    model_fingerprint = serializers.CharField(
        max_length=MAX_FINGERPRINT_LEN, help_text="Model name + revision or a weights digest."
    )
    num_layers = StrictIntegerField(min_value=1, max_value=MAX_SHAPE)
    num_kv_heads = StrictIntegerField(min_value=1, max_value=MAX_SHAPE, required=False)
    head_dim = StrictIntegerField(min_value=1, max_value=MAX_SHAPE, required=False)
    block_size = StrictIntegerField(min_value=1, max_value=MAX_BLOCK_SIZE, help_text="Tokens per block.")
    kv_dtype = serializers.ChoiceField(choices=KV_DTYPES)
    storage_dtype = serializers.ChoiceField(choices=STORAGE_DTYPES)
    attention = serializers.ChoiceField(
        choices=ATTENTION_KINDS,
        required=False,
        default="mha",
        help_text="mha: per-head K and V (MHA, GQA, MQA). mla: one latent row per token and layer (DeepSeek-V2/V3).",
    )
    kv_lora_rank = StrictIntegerField(
        min_value=0, max_value=MAX_SHAPE, required=False, default=0, help_text="mla: kv_c_normed width (else 0)."
    )
    qk_rope_head_dim = StrictIntegerField(
        min_value=0, max_value=MAX_SHAPE, required=False, default=0, help_text="mla: k_pe width (else 0)."
    )

    def validate(self, attrs):
        if attrs.get("attention") == "mla":
            heads, head_dim = latent_head_shape(attrs.get("kv_lora_rank", 0), attrs.get("qk_rope_head_dim", 0))
            attrs.setdefault("num_kv_heads", heads)
            attrs.setdefault("head_dim", head_dim)
        missing = {name: ["This field is required."] for name in ("num_kv_heads", "head_dim") if name not in attrs}
        if missing:
            raise serializers.ValidationError(missing)
        return attrs


class CapacitySerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    """Bytes per tier. device: at least one block; dram/ssd/network: 0 (default) or at least one block. device, dram
    and ssd are reserved on the cache's node; network is a share of the fleet's network store (outlives the node)."""

    device = StrictIntegerField(min_value=1, max_value=services.MAX_TIER_BYTES)
    dram = StrictIntegerField(min_value=0, max_value=services.MAX_TIER_BYTES, required=False, default=0)
    ssd = StrictIntegerField(min_value=0, max_value=services.MAX_TIER_BYTES, required=False, default=0)
    network = StrictIntegerField(
        min_value=0,
        max_value=services.MAX_TIER_BYTES,
        required=False,
        default=0,
        help_text="Bytes of the fleet's network store (0: none). 409 network_tier_absent when the fleet has none.",
    )


@extend_schema_serializer(component_name="Cache")
class CacheOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    tenant_id = serializers.UUIDField()
    name = serializers.CharField()
    spec = serializers.SerializerMethodField()
    capacity = serializers.SerializerMethodField()
    network_write_through = serializers.BooleanField(
        help_text="A put is acknowledged once its full blocks are in the network store (a lost node loses nothing "
        "acknowledged)."
    )
    block_bytes = serializers.SerializerMethodField(help_text="Bytes of one block in this layout.")
    state = serializers.ChoiceField(choices=CacheState.choices)
    failure_reason = serializers.CharField(help_text="Why the cache failed (e.g. node_lost); empty otherwise.")
    node_id = serializers.UUIDField(
        allow_null=True, help_text="The node hosting it; null before placement and once detached."
    )
    endpoint = serializers.CharField(
        help_text="The node's data-plane address once ready; empty before and once detached."
    )
    epoch = serializers.IntegerField(help_text="Grows whenever the cache moves to another node.")
    contents = serializers.SerializerMethodField(
        help_text="Only while ready (null otherwise: no node serves it). warm: its node's last heartbeat reported "
        "blocks of it; cold: none (nothing stored yet or all deleted; or emptied: its node came back without it, "
        "see emptied_at). Reads as of the last heartbeat."
    )
    emptied_at = serializers.DateTimeField(
        allow_null=True,
        help_text="The last time its node came back without its blocks (an agent restart without them, a lost "
        "pool): everything stored before is gone, engines recompute and refill it. Null: never.",
    )
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()

    def get_contents(self, cache) -> Literal["warm", "cold"] | None:
        if cache.state != CacheState.READY:
            return None
        known = self.context.get("contents") or {}  # a list's page: read once for all its caches (caches_contents)
        if cache.pk in known:
            return known[cache.pk]
        return "warm" if cache_resident_bytes_reported(cache) > 0 else "cold"

    def to_representation(self, cache):
        """A detached cache has no node: its node fields read null and empty (the row keeps the last node)."""
        data = super().to_representation(cache)
        if cache.state == CacheState.DETACHED:
            data["node_id"], data["endpoint"] = None, ""
        return data

    def get_spec(self, cache) -> SpecSerializer:
        return cache.spec_dict()

    def get_capacity(self, cache) -> CapacitySerializer:
        return cache.capacity()

    def get_block_bytes(self, cache) -> int:
        return KVCacheSpec(**cache.spec_dict()).block_bytes


def _tenant_scope(request, tenant_id) -> uuid.UUID | None:
    """The tenant id the caller's reads are confined to: its own for a key; the named one (or None: all) for staff."""
    if is_staff_user(request.user) and tenant_id is None:
        return None
    return request_tenant(request, tenant_id).pk


_TENANT_ID_PARAM = OpenApiParameter(
    "tenant_id", OpenApiTypes.UUID, required=False, description="Staff only: confine to this tenant."
)
_IDEMPOTENCY_PARAM = OpenApiParameter(
    IDEMPOTENCY_HEADER,
    str,
    location=OpenApiParameter.HEADER,
    required=False,
    pattern=KEY_PATTERN,
    description="Stripe semantics, per tenant: the same key and body replay the stored response "
    f"(with `{REPLAYED_HEADER}: true`); another body is 422 idempotency_key_reused; a concurrent duplicate is "
    "409 idempotency_in_progress. Only successful responses are stored.",
)
_REPLAYED_HEADER = OpenApiParameter(
    REPLAYED_HEADER, str, location=OpenApiParameter.HEADER, response=[201], description="`true` on a replay."
)


def _validated(serializer_class, data) -> dict:
    if hasattr(data, "dict"):  # a QueryDict: validate "?tenant_id=" as the empty string it is, not as "absent"
        data = data.dict()
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# ---- caches ---------------------------------------------------------------------------------------------------------


class CacheListAttachApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"
    pagination_class = BoundedLimitOffsetPagination
    parser_classes = [JSONParser]

    @extend_schema_serializer(component_name="CacheListFilter")
    class FilterSerializer(serializers.Serializer):
        tenant_id = serializers.UUIDField(required=False)
        state = serializers.ChoiceField(choices=CacheState.choices, required=False)

    @extend_schema_serializer(component_name="CacheAttachInput")
    class AttachInputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
        name = serializers.RegexField(
            NAME_PATTERN, max_length=63, help_text="Unique among the tenant's attached caches."
        )
        spec = SpecSerializer()
        capacity = CapacitySerializer()
        network_write_through = StrictBooleanField(
            required=False,
            default=False,
            help_text="Acknowledge a put only once its full blocks are in the network store (needs capacity.network).",
        )

    def idempotency_tenant_id(self, request):
        return request_tenant(request, _validated(self.FilterSerializer, request.query_params).get("tenant_id")).pk

    @extend_schema(
        operation_id="caches_list",
        summary="List caches",
        examples=[ex.CACHE_LIST],
        tags=["caches"],
        parameters=[
            _TENANT_ID_PARAM,
            OpenApiParameter("state", str, enum=CacheState.values, required=False),
            *RATE_LIMIT_HEADERS,
        ],
        responses={200: CacheOutputSerializer(many=True), **error_responses(*AUTH_ERRORS, 404)},
        description=(
            "The tenant's caches, newest first, paginated (limit/offset), optionally filtered by state; detached "
            "caches are listed too. Each shows its spec, capacity, state, node endpoint once ready, epoch, and "
            "whether it holds blocks (`contents`, `emptied_at`). Needs caches:read; staff list every tenant's, or "
            "one with tenant_id."
        ),
    )
    def get(self, request):
        filters = _validated(self.FilterSerializer, request.query_params)
        caches = selectors.cache_list(
            tenant_id=_tenant_scope(request, filters.get("tenant_id")), state=filters.get("state")
        )
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(caches, request, view=self)
        contents = caches_contents(page)
        return paginator.get_paginated_response(
            CacheOutputSerializer(page, many=True, context={"contents": contents}).data
        )

    @extend_schema(
        operation_id="caches_attach",
        summary="Attach a cache",
        examples=[ex.ATTACH_REQUEST, ex.ATTACHED],
        tags=["caches"],
        request=AttachInputSerializer,
        parameters=[_TENANT_ID_PARAM, _IDEMPOTENCY_PARAM, _REPLAYED_HEADER, *RATE_LIMIT_HEADERS],
        responses={
            201: CacheOutputSerializer,
            **error_responses(*AUTH_ERRORS, 404, 409, 422, 503),
        },
        description="Attach a cache. 400 invalid_spec / invalid_capacity (network_write_through without "
        "capacity.network too) / validation_error; 403 quota_exceeded (details.limit names the limit) or "
        "permission_denied; 409 cache_name_taken (details: the name, and cache_id and state of the cache holding "
        "it), idempotency_in_progress or network_tier_absent (capacity.network asked of a fleet without a network "
        "store); 422 idempotency_key_reused; 503 no_capacity (no node has the "
        "device/dram/ssd bytes, or the network store has not the network bytes left: details.largest_free). The "
        "cache is returned `provisioning`; it becomes `ready` (or `failed`) when its node answers.",
    )
    @idempotent
    def post(self, request):
        tenant = request_tenant(request, _validated(self.FilterSerializer, request.query_params).get("tenant_id"))
        body = self.AttachInputSerializer(data=request.data)
        if not body.is_valid():
            errors = dict(body.errors)
            if "spec" in errors:
                raise InvalidSpec("The KV cache spec is invalid.", details={"fields": errors})
            if "capacity" in errors:
                raise InvalidCapacity("The capacity is invalid.", details={"fields": errors})
            raise serializers.ValidationError(errors)
        data = body.validated_data
        try:
            spec = KVCacheSpec(**data["spec"])
        except SpecError as exc:
            raise InvalidSpec(str(exc), details={"fields": {"spec": [str(exc)]}}) from None
        cache = services.cache_attach(
            tenant_id=tenant.pk,
            name=data["name"],
            spec=spec,
            capacity=dict(data["capacity"]),
            network_write_through=data["network_write_through"],
        )
        return Response(CacheOutputSerializer(cache).data, status=status.HTTP_201_CREATED)


class CacheDetailDetachApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"

    @extend_schema(
        operation_id="caches_retrieve",
        summary="Retrieve a cache",
        examples=[ex.CACHE_READY],
        tags=["caches"],
        parameters=RATE_LIMIT_HEADERS,
        responses={200: CacheOutputSerializer, **error_responses(*AUTH_ERRORS, 404)},
        description=(
            "One cache of the tenant: spec, capacity, state (and failure_reason), the node endpoint engines "
            "connect to once ready, its epoch, and `contents` warm|cold with `emptied_at` (when its node last "
            "came back without its blocks). Another tenant's cache is a 404, like a missing one. Needs "
            "caches:read."
        ),
    )
    def get(self, request, cache_id):
        cache = selectors.cache_get(cache_id=cache_id, tenant_id=_tenant_scope(request, None))
        return Response(CacheOutputSerializer(cache).data)

    @extend_schema(
        operation_id="caches_detach",
        summary="Detach a cache",
        examples=[ex.DETACHING],
        tags=["caches"],
        request=None,
        parameters=RATE_LIMIT_HEADERS,
        responses={
            202: OpenApiResponse(CacheOutputSerializer, description="Detaching (or already detaching)."),
            200: OpenApiResponse(CacheOutputSerializer, description="Already detached: its state, unchanged."),
            **error_responses(*AUTH_ERRORS, 404),
        },
        description="Detach: the cache becomes `detaching`, its node drops it and it becomes `detached` (a failed "
        "cache is detached at once). Idempotent. Outstanding data tokens are revoked.",
    )
    def delete(self, request, cache_id):
        cache = services.cache_detach(cache_id=cache_id, tenant_id=_tenant_scope(request, None))
        code = status.HTTP_200_OK if cache.state == CacheState.DETACHED else status.HTTP_202_ACCEPTED
        return Response(CacheOutputSerializer(cache).data, status=code)


# ---- data tokens ----------------------------------------------------------------------------------------------------


class DataTokenPermission(BasePermission):
    """Data tokens are for tenant keys holding at least caches:read (the access level is checked on the body);
    staff users and nodes get none: reading a tenant's KV is the tenant's own capability."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not isinstance(user, TenantPrincipal):
            return False
        if not user.has_scope("caches", "read"):
            raise _missing_scope("caches:read")
        return True


def _missing_scope(scope: str) -> ApplicationError:
    return ApplicationError(
        f"This key lacks the {scope} scope.",
        code="permission_denied",
        status_code=403,
        details={"required_scope": scope},
    )


class DataTokenIssueApi(APIView):
    permission_classes = [DataTokenPermission]
    parser_classes = [JSONParser]

    @extend_schema_serializer(component_name="DataTokenIssueInput")
    class InputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
        access = serializers.ChoiceField(
            choices=services.ACCESS_LEVELS,
            default="read",
            help_text="read (lookup/get; needs caches:read) or readwrite (also put/delete; needs caches:write).",
        )
        ttl_seconds = StrictIntegerField(
            required=False,
            min_value=1,
            max_value=2**31 - 1,
            help_text="Requested lifetime, clamped to [60, the configured maximum].",
        )

    @extend_schema_serializer(component_name="DataToken")
    class OutputSerializer(serializers.Serializer):
        token = serializers.CharField(help_text="The JWT (EdDSA); verify with /.well-known/jwks.json.")
        token_type = serializers.CharField(default="Bearer")
        jti = serializers.UUIDField()
        cache_id = serializers.UUIDField()
        access = serializers.ChoiceField(choices=services.ACCESS_LEVELS)
        epoch = serializers.IntegerField()
        node_id = serializers.UUIDField()
        endpoint = serializers.CharField()
        expires_at = serializers.DateTimeField()

    @extend_schema(
        operation_id="caches_tokens_create",
        summary="Issue a data-plane token for a cache",
        examples=[ex.TOKEN_REQUEST, ex.TOKEN_ISSUED],
        tags=["tokens"],
        request=InputSerializer,
        parameters=RATE_LIMIT_HEADERS,
        responses={201: OutputSerializer, **error_responses(*AUTH_ERRORS, 404, 409)},
        description="Issue a short-lived data-plane token for one ready cache: aud `cache:<id>`, sub "
        "`tenant:<id>`, with epoch, node and access claims. 403 quota_exceeded past max_data_tokens_outstanding; "
        "409 cache_not_ready.",
    )
    def post(self, request, cache_id):
        data = _validated(self.InputSerializer, request.data)
        if data["access"] == "readwrite" and not request.user.has_scope("caches", "write"):
            raise _missing_scope("caches:write")
        issued = services.data_token_issue(
            tenant_id=request.user.tenant.pk,
            cache_id=cache_id,
            access=data["access"],
            ttl_seconds=data.get("ttl_seconds"),
            api_key_id=getattr(request.auth, "pk", None),  # the key's revocation revokes the token too
        )
        token = issued.data_token
        body = {
            "token": issued.token,
            "token_type": "Bearer",
            "jti": token.jti,
            "cache_id": token.cache_id,
            "access": token.access,
            "epoch": issued.claims["epoch"],
            "node_id": issued.claims["node"],
            "endpoint": token.cache.endpoint,
            "expires_at": token.expires_at,
        }
        return Response(self.OutputSerializer(body).data, status=status.HTTP_201_CREATED)


class DataTokenRevokePermission(BasePermission):
    """Revoking data tokens needs caches:write (a read-only key cannot cut off its tenant's writers); staff pass
    (incident response for any tenant)."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if is_staff_user(user):
            return True
        if not isinstance(user, TenantPrincipal):
            return False
        if not user.has_scope("caches", "write"):
            raise _missing_scope("caches:write")
        return True


@extend_schema_serializer(component_name="DataTokensRevoked")
class DataTokensRevokedSerializer(serializers.Serializer):
    revoked = serializers.IntegerField(help_text="Tokens revoked by this call (0 when already revoked or expired).")


_REVOKE_DESCRIPTION = (
    "The cache's node refuses revoked tokens on new HELLOs and on connections already opened with them, from the "
    "moment the control plane's push reaches it (at the latest its next heartbeat). Idempotent."
)


class DataTokenRevokeApi(APIView):
    permission_classes = [DataTokenRevokePermission]

    @extend_schema(
        operation_id="caches_tokens_revoke",
        tags=["tokens"],
        request=None,
        parameters=RATE_LIMIT_HEADERS,
        responses={200: DataTokensRevokedSerializer, **error_responses(*AUTH_ERRORS, 404)},
        summary="Revoke one data token of the cache",
        examples=[ex.TOKEN_REVOKED],
        description=_REVOKE_DESCRIPTION + " 404 for a jti that is not a token of this cache.",
    )
    def post(self, request, cache_id, jti):
        revoked = services.data_tokens_revoke(cache_id=cache_id, tenant_id=_tenant_scope(request, None), jti=jti)
        return Response(DataTokensRevokedSerializer({"revoked": revoked}).data)


class DataTokensRevokeAllApi(APIView):
    permission_classes = [DataTokenRevokePermission]

    @extend_schema(
        operation_id="caches_tokens_revoke_all",
        tags=["tokens"],
        request=None,
        parameters=RATE_LIMIT_HEADERS,
        responses={200: DataTokensRevokedSerializer, **error_responses(*AUTH_ERRORS, 404)},
        summary="Revoke every outstanding data token of the cache",
        examples=[ex.TOKENS_REVOKED],
        description=_REVOKE_DESCRIPTION,
    )
    def post(self, request, cache_id):
        revoked = services.data_tokens_revoke(cache_id=cache_id, tenant_id=_tenant_scope(request, None))
        return Response(DataTokensRevokedSerializer({"revoked": revoked}).data)


# ---- JWKS -----------------------------------------------------------------------------------------------------------


class JwkSerializer(serializers.Serializer):
    kty = serializers.CharField()
    crv = serializers.CharField()
    x = serializers.CharField(help_text="The raw Ed25519 public key, base64url without padding.")
    kid = serializers.CharField(help_text="RFC 7638 thumbprint; the `kid` header of tokens it signed.")
    use = serializers.CharField()
    alg = serializers.CharField()


class JwksApi(APIView):
    """The public keys verifying data-plane tokens (RFC 7517). Public: no credentials, not rate limited."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema_serializer(component_name="Jwks")
    class OutputSerializer(serializers.Serializer):
        keys = JwkSerializer(many=True)

    @extend_schema(
        operation_id="jwks",
        summary="Public keys that verify data-plane tokens (JWKS)",
        examples=[ex.JWKS],
        tags=["well-known"],
        auth=[],
        responses={200: OutputSerializer},
    )
    def get(self, request):
        response = Response(self.OutputSerializer(signing.jwks()).data)
        response["Cache-Control"] = "public, max-age=300"
        return response
