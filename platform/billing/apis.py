"""REST API of the billing room: node usage reports, the tenant's usage (snapshot and metered series, JSON or CSV),
invoices, and the staff's rates. Each view validates, calls one service or selector, and serializes.

Tenant isolation: a tenant key reads only its own usage and invoices (naming another tenant, or another's invoice
id, is a 404); staff read every tenant's (invoices optionally filtered by tenant_id) and manage rates.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from datetime import timedelta

from django.http import HttpResponse
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import serializers, status
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import api_examples as ex
from billing import money, selectors, services
from billing.errors import InvalidPeriod
from billing.models import METERS, TIERS, InvoiceStatus
from caches import selectors as cache_selectors
from core.errors import ApplicationError
from core.openapi import AUTH_ERRORS, RATE_LIMIT_HEADERS, RejectUnknownFieldsMixin, error_responses
from core.pagination import MAX_LIMIT, MAX_OFFSET, BoundedLimitOffsetPagination
from core.permissions import IsStaff, ScopePermission
from fleet.authentication import NodeCredentialAuthentication
from fleet.permissions import IsNode
from tenants import selectors as tenant_selectors
from tenants.fields import StrictIntegerField
from tenants.principals import TenantPrincipal, is_staff_user, request_tenant

MAX_REPORT_ENTRIES = 10_000  # caches in one node report
MAX_COUNTER = 2**62  # bytes and counters: far above any node, inside PostgreSQL's bigint
MAX_SERIES_DAYS = {"hour": 400, "day": 3660, "month": 3660}  # at most ~10 000 buckets per answer


@extend_schema_serializer(component_name="PageQuery")
class PageQuerySerializer(serializers.Serializer):
    """The bounds BoundedLimitOffsetPagination enforces, published as query parameters."""

    limit = serializers.IntegerField(min_value=1, max_value=MAX_LIMIT, required=False, help_text="page size")
    offset = serializers.IntegerField(
        min_value=0, max_value=MAX_OFFSET, required=False, help_text="index of the first item"
    )


PAGE_PARAMS = [PageQuerySerializer]
_TENANT_ID_PARAM = OpenApiParameter(
    "tenant_id", OpenApiTypes.UUID, required=False, description="Staff only: the tenant (required for usage)."
)


def _page_of(serializer, name: str):
    """The schema of a BoundedLimitOffsetPagination page of `serializer` items."""
    return inline_serializer(
        name=name,
        fields={
            "count": serializers.IntegerField(),
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": serializer(many=True),
        },
    )


def _validated(serializer_class, data) -> dict:
    if hasattr(data, "dict"):  # a QueryDict: one value per parameter
        data = data.dict()
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


@extend_schema_field({"type": "string", "format": "decimal", "example": "3.5"})
class ExactDecimalField(serializers.Field):
    """A Decimal as its exact string, without trailing zeros ("3.5", never a float)."""

    def to_representation(self, value):
        return money.decimal_text(value)


# ---- node usage reports ---------------------------------------------------------------------------------------------


class UsageEntrySerializer(serializers.Serializer):
    cache_id = serializers.UUIDField()
    device_bytes = StrictIntegerField(min_value=0, max_value=MAX_COUNTER)
    dram_bytes = StrictIntegerField(min_value=0, max_value=MAX_COUNTER)
    ssd_bytes = StrictIntegerField(min_value=0, max_value=MAX_COUNTER)
    network_bytes = StrictIntegerField(
        min_value=0,
        max_value=MAX_COUNTER,
        required=False,
        default=0,
        help_text="the cache's objects in the fleet's network store; absent (0) from agents without a network tier",
    )
    bytes_written_total = StrictIntegerField(
        min_value=0, max_value=MAX_COUNTER, help_text="KV bytes written by puts since the agent's boot"
    )
    tokens_served_total = StrictIntegerField(
        min_value=0, max_value=MAX_COUNTER, help_text="tokens of KV sent by GET answers since the boot"
    )


class RefusedEntrySerializer(serializers.Serializer):
    cache_id = serializers.UUIDField()
    reason = serializers.CharField()


class NodeUsageReportApi(APIView):
    authentication_classes = [NodeCredentialAuthentication]
    parser_classes = [JSONParser]
    permission_classes = [IsNode]
    throttle_classes: list = []

    @extend_schema_serializer(component_name="NodeUsageReport")
    class InputSerializer(serializers.Serializer):
        boot_id = serializers.UUIDField(help_text="random per agent process start")
        sequence = StrictIntegerField(min_value=1, max_value=MAX_COUNTER, help_text="grows by report")
        sampled_at = serializers.DateTimeField(help_text="RFC 3339, the node's clock (whole seconds count)")
        caches = UsageEntrySerializer(many=True, max_length=MAX_REPORT_ENTRIES)

        def validate_caches(self, entries):
            ids = [entry["cache_id"] for entry in entries]
            if len(ids) != len(set(ids)):
                raise serializers.ValidationError("each cache_id may appear once")
            return entries

    @extend_schema_serializer(component_name="NodeUsageReportAck")
    class OutputSerializer(serializers.Serializer):
        duplicate = serializers.BooleanField(help_text="this (boot_id, sequence) was recorded before: nothing changed")
        late = serializers.BooleanField(help_text="sampled before the grace window: ignored, nothing stored")
        accepted = serializers.IntegerField()
        refused = RefusedEntrySerializer(many=True, help_text="entries for caches not placed on this node")

    @extend_schema(
        operation_id="nodes_usage",
        tags=["nodes"],
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(400, 401)},
        summary="Report the calling node's per-cache usage (absolute snapshots and counters since boot)",
        examples=[ex.USAGE_REPORT, ex.USAGE_REPORT_ACK, ex.USAGE_REPORT_FROM_THE_FUTURE],
        description="Called by a node agent, with its node credential, about once a minute: the bytes each cache "
        "it hosts holds per tier at sampled_at (absolute) and the bytes written and tokens served since the "
        "agent's boot (counters), which billing meters into GB-hours. Idempotent on (node, boot_id, sequence): a "
        "repeat answers duplicate true and changes nothing; a report older than KCAAS_USAGE_GRACE_SECONDS answers "
        "late true and is ignored; entries for caches not placed on the node are refused (listed in `refused`, "
        "audited) and the others stored. Errors: 400 validation_error, or invalid_usage_report for a sampled_at "
        "ahead of the control plane's clock by more than KCAAS_USAGE_MAX_CLOCK_SKEW_SECONDS; 401 for anything but "
        "a valid node credential.",
    )
    def post(self, request):
        data = _validated(self.InputSerializer, request.data)
        outcome = services.usage_report_record(
            node_id=request.user.node.pk,
            boot_id=data["boot_id"],
            sequence=data["sequence"],
            sampled_at=data["sampled_at"],
            entries=[dict(entry) for entry in data["caches"]],
        )
        return Response(self.OutputSerializer(dataclasses.asdict(outcome)).data)


# ---- usage ----------------------------------------------------------------------------------------------------------


class UsagePermission(BasePermission):
    """Usage is readable with caches:read or usage:read (write implies read); staff pass (naming the tenant)."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if is_staff_user(user):
            return True
        if not isinstance(user, TenantPrincipal):
            return False  # DRF answers 401 for no credentials, 403 for other principals
        if user.has_scope("caches", "read") or user.has_scope("usage", "read"):
            return True
        raise ApplicationError(
            "This key lacks the caches:read scope.",
            code="permission_denied",
            status_code=403,
            details={"required_scope": "caches:read"},
        )


class _FormatIsAParameter(DefaultContentNegotiation):
    """`format` is the usage view's own parameter (json|csv), not DRF's renderer override: answers stay JSON
    unless the view itself returns CSV."""

    class settings:  # noqa: N801 - mirrors api_settings, which DefaultContentNegotiation reads
        URL_FORMAT_OVERRIDE = None


def _per_tier(values: dict[str, int]) -> dict[str, int]:
    return {f"{tier}_bytes": values[tier] for tier in TIERS}


@extend_schema_serializer(component_name="UsageLimits")
class UsageLimitsSerializer(serializers.Serializer):
    """Effective limits: the tenant's overrides merged over the defaults."""

    max_caches = serializers.IntegerField()
    max_device_bytes = serializers.IntegerField()
    max_dram_bytes = serializers.IntegerField()
    max_ssd_bytes = serializers.IntegerField()
    max_network_bytes = serializers.IntegerField()
    max_requests_per_second = serializers.IntegerField()
    max_data_tokens_outstanding = serializers.IntegerField()
    max_api_keys = serializers.IntegerField()


class TierBytesSerializer(serializers.Serializer):
    device_bytes = serializers.IntegerField(min_value=0)
    dram_bytes = serializers.IntegerField(min_value=0)
    ssd_bytes = serializers.IntegerField(min_value=0)
    network_bytes = serializers.IntegerField(min_value=0, help_text="The fleet's network store (not a node's).")


@extend_schema_serializer(component_name="UsageUsed")
class UsageUsedSerializer(TierBytesSerializer):
    """What the quota checks count: non-detached caches (failed ones until detached) and their capacity per tier."""

    caches = serializers.IntegerField(min_value=0)
    data_tokens_outstanding = serializers.IntegerField(min_value=0, help_text="Neither expired nor revoked.")
    api_keys = serializers.IntegerField(min_value=0, help_text="Usable API keys: neither revoked nor expired.")


@extend_schema_serializer(component_name="UsageResident")
class UsageResidentSerializer(TierBytesSerializer):
    """Bytes per tier the nodes last reported holding for those caches (heartbeat snapshots)."""


@extend_schema_serializer(component_name="Usage")
class UsageSerializer(serializers.Serializer):
    tenant_id = serializers.UUIDField()
    limits = UsageLimitsSerializer()
    used = UsageUsedSerializer()
    resident = UsageResidentSerializer()
    over_quota = serializers.BooleanField(
        help_text="Some use is above its limit: a quota was lowered below it (accepted; nothing is taken away, "
        "new caches, keys or tokens past the limit are refused)."
    )
    over_quota_limits = serializers.ListField(
        child=serializers.CharField(), help_text='The limits the use is above, e.g. ["max_device_bytes"].'
    )


@extend_schema_serializer(component_name="UsageBucket")
class UsageBucketSerializer(serializers.Serializer):
    period_start = serializers.DateTimeField()
    device_byte_seconds = serializers.IntegerField()
    dram_byte_seconds = serializers.IntegerField()
    ssd_byte_seconds = serializers.IntegerField()
    network_byte_seconds = serializers.IntegerField()
    device_gb_hours = serializers.CharField(help_text="byte-seconds / 3.6e12, an exact decimal string")
    dram_gb_hours = serializers.CharField()
    ssd_gb_hours = serializers.CharField()
    network_gb_hours = serializers.CharField()
    bytes_written = serializers.IntegerField()
    tokens_served = serializers.IntegerField()


@extend_schema_serializer(component_name="UsageSeries")
class UsageSeriesSerializer(serializers.Serializer):
    def get_fields(self):  # "from" is a Python keyword: the fields are named here
        return {
            "from": serializers.DateTimeField(),
            "to": serializers.DateTimeField(),
            "granularity": serializers.ChoiceField(choices=list(selectors.GRANULARITIES)),
            "buckets": UsageBucketSerializer(many=True),
        }


@extend_schema_serializer(component_name="UsageWithSeries")
class UsageWithSeriesSerializer(UsageSerializer):
    series = UsageSeriesSerializer()


class UsageAnswerSerializer(serializers.Serializer):
    """Schema only: the snapshot (Usage) or, with a period, the snapshot and its series (UsageWithSeries)."""


class UsageAnswerSchema(OpenApiSerializerExtension):
    """anyOf, not oneOf: a body with a series also has every field of the snapshot."""

    target_class = UsageAnswerSerializer

    def get_name(self, auto_schema, direction):
        return "UsageAnswer"

    def map_serializer(self, auto_schema, direction):
        branches = (UsageSerializer, UsageWithSeriesSerializer)
        return {"anyOf": [auto_schema.resolve_serializer(branch, direction).ref for branch in branches]}


NODE_TIERS = ("device", "dram", "ssd")
CSV_COLUMNS = [  # the network tier's columns last: the earlier columns keep their places
    "period_start",
    *(f"{t}_byte_seconds" for t in NODE_TIERS),
    *(f"{t}_gb_hours" for t in NODE_TIERS),
    "bytes_written",
    "tokens_served",
    "network_byte_seconds",
    "network_gb_hours",
]


class UsageApi(APIView):
    """The tenant's effective quota limits next to its consumption and, for a period, its metered usage."""

    permission_classes = [UsagePermission]
    content_negotiation_class = _FormatIsAParameter

    @extend_schema_serializer(component_name="UsageFilter")
    class FilterSerializer(serializers.Serializer):
        def get_fields(self):  # "from" is a Python keyword: the fields are named here
            return {
                "tenant_id": serializers.UUIDField(required=False),
                "from": serializers.DateTimeField(required=False),
                "to": serializers.DateTimeField(required=False),
                "granularity": serializers.ChoiceField(choices=list(selectors.GRANULARITIES), required=False),
                "format": serializers.ChoiceField(choices=["json", "csv"], required=False, default="json"),
            }

        def validate(self, attrs):
            period = [attrs.get("from"), attrs.get("to")]
            wants_series = any(period) or "granularity" in attrs or attrs["format"] == "csv"
            if wants_series and not all(period):
                raise InvalidPeriod("The metered series needs both from and to.")
            if wants_series:
                _check_period(attrs["from"], attrs["to"], attrs.setdefault("granularity", "day"))
            attrs["wants_series"] = wants_series
            return attrs

    @extend_schema(
        operation_id="usage_retrieve",
        summary="Quota limits and current usage",
        examples=[ex.USAGE],
        tags=["usage"],
        parameters=[
            _TENANT_ID_PARAM,
            OpenApiParameter("from", OpenApiTypes.DATETIME, required=False, description="series start (inclusive)"),
            OpenApiParameter("to", OpenApiTypes.DATETIME, required=False, description="series end (exclusive)"),
            OpenApiParameter(
                "granularity",
                str,
                enum=list(selectors.GRANULARITIES),
                required=False,
                description="series buckets (UTC), default day",
            ),
            OpenApiParameter(
                "format",
                str,
                enum=["json", "csv"],
                required=False,
                description="csv: the series as CSV (needs from and to)",
            ),
            *RATE_LIMIT_HEADERS,
        ],
        responses={
            (200, "application/json"): UsageAnswerSerializer,
            (200, "text/csv"): OpenApiTypes.STR,
            **error_responses(*AUTH_ERRORS, 404),
        },
        description="Quota limits and current consumption: the counts the quota checks compare with them (a "
        "snapshot, not locked), and the bytes the nodes report resident. With from/to (and granularity "
        "hour|day|month) also the metered series from the billing ledger: byte-seconds and GB-hours (exact "
        "decimal strings) per tier, bytes written, tokens served; format=csv answers the series as CSV. "
        "Needs caches:read or usage:read. 400 invalid_period for an empty, reversed or too long period.",
    )
    def get(self, request):
        query = _validated(self.FilterSerializer, request.query_params)
        tenant = request_tenant(request, query.get("tenant_id"))
        series = _series(tenant.pk, query) if query["wants_series"] else None
        if query["format"] == "csv":
            assert series is not None, "csv asks for a series (FilterSerializer sets wants_series)"
            return _csv_response(tenant.pk, series)
        body = UsageSerializer(_snapshot(tenant)).data
        if series is not None:
            body["series"] = UsageSeriesSerializer(series).data
        return Response(body)


def _check_period(start, end, granularity: str) -> None:
    if end <= start:
        raise InvalidPeriod("to must be after from.", details={"from": str(start), "to": str(end)})
    if end - start > timedelta(days=MAX_SERIES_DAYS[granularity]):
        raise InvalidPeriod(
            f"A series by {granularity} spans at most {MAX_SERIES_DAYS[granularity]} days.",
            details={"max_days": MAX_SERIES_DAYS[granularity]},
        )


def _snapshot(tenant) -> dict:
    usage = cache_selectors.tenant_usage(tenant=tenant)
    limits = dataclasses.asdict(usage.limits)
    used = {
        "caches": usage.caches.num_caches,
        **_per_tier(usage.caches.capacity_bytes),
        "data_tokens_outstanding": usage.data_tokens_outstanding,
        "api_keys": tenant_selectors.api_keys_usable(tenant_id=tenant.pk).count(),
    }
    over = [f"max_{name}" for name, count in used.items() if count > limits[f"max_{name}"]]
    return {
        "tenant_id": tenant.pk,
        "limits": limits,
        "used": used,
        "resident": _per_tier(usage.resident_bytes),
        "over_quota": bool(over),
        "over_quota_limits": over,
    }


def _series(tenant_id, query: dict) -> dict:
    buckets = selectors.usage_series(
        tenant_id=tenant_id, start=query["from"], end=query["to"], granularity=query["granularity"]
    )
    return {
        "from": query["from"],
        "to": query["to"],
        "granularity": query["granularity"],
        "buckets": [bucket.as_dict() for bucket in buckets],
    }


def _csv_response(tenant_id, series: dict) -> HttpResponse:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(series["buckets"])
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    start, end = (series[k].strftime("%Y%m%dT%H%M%SZ") for k in ("from", "to"))
    response["Content-Disposition"] = f'attachment; filename="usage-{tenant_id}-{start}-{end}.csv"'
    return response


# ---- invoices -------------------------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="InvoiceLine")
class InvoiceLineSerializer(serializers.Serializer):
    cache_id = serializers.UUIDField()
    meter = serializers.ChoiceField(choices=list(METERS))
    usage = serializers.IntegerField(help_text="base units: byte-seconds, bytes or tokens")
    quantity = ExactDecimalField(help_text="in the meter's unit (GB-hours, GB, million tokens)")
    unit_price = ExactDecimalField()
    rate_effective_from = serializers.DateTimeField()
    amount = ExactDecimalField(help_text="quantity x unit_price, unrounded")


@extend_schema_serializer(component_name="Invoice")
class InvoiceSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    tenant_id = serializers.UUIDField()
    month = serializers.SerializerMethodField(help_text="YYYY-MM (UTC)")
    status = serializers.ChoiceField(choices=InvoiceStatus.choices)
    currency = serializers.CharField()
    subtotal = ExactDecimalField(help_text="the sum of the line amounts, unrounded")
    total = serializers.DecimalField(
        max_digits=20, decimal_places=2, help_text="subtotal rounded once to the cent, half to even"
    )
    generated_at = serializers.DateTimeField()
    finalised_at = serializers.DateTimeField(allow_null=True)
    lines = InvoiceLineSerializer(many=True, source="lines.all")

    def get_month(self, invoice) -> str:
        return invoice.month.strftime("%Y-%m")


class _InvoiceApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "usage"


class InvoiceListApi(_InvoiceApi):
    @extend_schema_serializer(component_name="InvoiceFilter")
    class FilterSerializer(serializers.Serializer):
        tenant_id = serializers.UUIDField(required=False)

    @extend_schema(
        operation_id="invoices_list",
        summary="List invoices",
        examples=[ex.INVOICE_LIST],
        tags=["invoices"],
        parameters=[_TENANT_ID_PARAM, *PAGE_PARAMS, *RATE_LIMIT_HEADERS],
        responses={200: _page_of(InvoiceSerializer, "PaginatedInvoiceList"), **error_responses(*AUTH_ERRORS, 404)},
        description="The tenant's invoices, newest month first (staff: every tenant's, or tenant_id's). Needs "
        "usage:read.",
    )
    def get(self, request):
        tenant_id = _tenant_scope(request, _validated(self.FilterSerializer, request.query_params).get("tenant_id"))
        paginator = BoundedLimitOffsetPagination()
        page = paginator.paginate_queryset(selectors.invoices_for_tenant(tenant_id=tenant_id), request, view=self)
        return paginator.get_paginated_response(InvoiceSerializer(page, many=True).data)


class InvoiceDetailApi(_InvoiceApi):
    @extend_schema(
        operation_id="invoices_retrieve",
        summary="Retrieve an invoice",
        examples=[ex.INVOICE_ONE],
        tags=["invoices"],
        parameters=RATE_LIMIT_HEADERS,
        responses={200: InvoiceSerializer, **error_responses(*AUTH_ERRORS, 404)},
        description=(
            "One invoice with its lines (per cache and meter; amounts as exact decimal strings). A tenant key "
            "sees only its own tenant's invoices (another tenant's id is a 404); staff see any."
        ),
    )
    def get(self, request, invoice_id):
        tenant_id = None if is_staff_user(request.user) else request_tenant(request).pk
        return Response(InvoiceSerializer(selectors.invoice_get(invoice_id=invoice_id, tenant_id=tenant_id)).data)


def _tenant_scope(request, tenant_id):
    """Own tenant for a key; the named tenant (or None: all) for staff."""
    if is_staff_user(request.user) and tenant_id is None:
        return None
    return request_tenant(request, tenant_id).pk


# ---- rates (staff) --------------------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="Rate")
class RateSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    meter = serializers.ChoiceField(choices=list(METERS))
    unit_price = serializers.DecimalField(max_digits=24, decimal_places=10, min_value=0, coerce_to_string=True)
    effective_from = serializers.DateTimeField(help_text="a whole UTC hour; until the meter's next rate")
    created_at = serializers.DateTimeField(read_only=True)


class AdminRatesApi(APIView):
    permission_classes = [IsStaff]
    parser_classes = [JSONParser]

    @extend_schema_serializer(component_name="RateFilter")
    class FilterSerializer(serializers.Serializer):
        meter = serializers.ChoiceField(choices=list(METERS), required=False)

    @extend_schema(
        operation_id="admin_rates_list",
        summary="List the price list's rates (staff)",
        examples=[ex.RATE_LIST],
        tags=["admin"],
        parameters=[FilterSerializer, *PAGE_PARAMS],
        responses={200: _page_of(RateSerializer, "PaginatedRateList"), **error_responses(*AUTH_ERRORS)},
        description=(
            "The price list: every rate (meter, unit price as an exact decimal string, effective_from) by meter, "
            "then by effective_from, optionally for one meter. A rate applies from its whole UTC hour until the "
            "same meter's next rate."
        ),
    )
    def get(self, request):
        rates = selectors.rate_list(meter=_validated(self.FilterSerializer, request.query_params).get("meter"))
        paginator = BoundedLimitOffsetPagination()
        page = paginator.paginate_queryset(rates, request, view=self)
        return paginator.get_paginated_response(RateSerializer(page, many=True).data)

    @extend_schema(
        operation_id="admin_rates_create",
        summary="Add a rate to the price list (staff)",
        examples=[ex.RATE_CREATE, ex.RATE_CREATED],
        tags=["admin"],
        request=RateSerializer,
        responses={201: RateSerializer, **error_responses(*AUTH_ERRORS, 409)},
        description="Audited (rate.created). 400 invalid_rate (effective_from not a whole UTC hour); "
        "409 rate_exists (same meter and time: rates are never edited, a later supersedes).",
    )
    def post(self, request):
        data = _validated(RateSerializer, request.data)
        rate = services.rate_create(
            meter=data["meter"], unit_price=data["unit_price"], effective_from=data["effective_from"]
        )
        return Response(RateSerializer(rate).data, status=status.HTTP_201_CREATED)
