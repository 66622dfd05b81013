"""REST API of the privacy room: erasure jobs (staff) and portability exports (tenant key or staff).

Each view validates, calls one service or selector, and serializes. Staff endpoints admit Django staff users only
(a tenant key gets 403). The tenant export needs a key holding the read scope of every resource the archive covers
(EXPORT_SCOPES): an archive never shows a key more than it could read piece by piece.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import JSONParser
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ApplicationError
from core.openapi import error_responses
from core.permissions import IsStaff
from privacy import api_examples as ex
from privacy import export, receipt, selectors, services
from privacy.models import ErasureState
from tenants import scopes as scope_rules
from tenants.principals import TenantPrincipal
from tenants.selectors import tenant_get

EXPORT_SCOPES = ("audit:read", "caches:read", "keys:read", "usage:read")


class PurgeOutputSerializer(serializers.Serializer):
    node_id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=["pending", "confirmed"])
    send_count = serializers.IntegerField()
    confirmed_at = serializers.DateTimeField(allow_null=True)
    freed_bytes = serializers.IntegerField()


class ErasureJobSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    tenant_id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=ErasureState.choices)
    requested_by = serializers.CharField()
    requested_at = serializers.DateTimeField()
    scheduled_for = serializers.DateTimeField(allow_null=True, help_text="End of the grace window.")
    started_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)
    cancelled_at = serializers.DateTimeField(allow_null=True)
    error = serializers.CharField()
    purges = PurgeOutputSerializer(many=True, source="purges.all")
    receipt_available = serializers.SerializerMethodField()

    def get_receipt_available(self, job) -> bool:
        return job.receipt is not None


class _StaffApi(APIView):
    permission_classes = [IsStaff]
    parser_classes = [JSONParser]


class ErasureApi(_StaffApi):
    @extend_schema(
        operation_id="admin_tenant_erasure_request",
        tags=["privacy"],
        request=None,
        responses={201: ErasureJobSerializer, 200: ErasureJobSerializer, **error_responses(401, 403, 404)},
        summary="Request the tenant's erasure (staff; idempotent: a second request returns the same job)",
        examples=[ex.ERASURE_REQUESTED, ex.ERASURE_ALREADY_REQUESTED, ex.NO_SUCH_TENANT],
        description=(
            "Starts the GDPR Art. 17 erasure of a tenant: after its grace window (KCAAS_ERASURE_GRACE_SECONDS, 24 "
            "hours by default, during which it can be cancelled) the job suspends the tenant, revokes its keys and "
            "data tokens, purges every block of the tenant on every node and tier, destroys its data keys "
            "(crypto-shredding) and ends with a signed deletion receipt. 201 with the new job (state scheduled); "
            "200 with the existing one when an erasure was already requested (a job in error is re-scheduled to "
            "run at once). No body. Staff only (basic auth); a tenant key gets 403 permission_denied. Errors: 401 "
            "without credentials; 404 not_found for an unknown tenant."
        ),
    )
    def post(self, request, tenant_id):
        job, created = services.erasure_request(
            tenant_id=tenant_id, requested_by=services.erasure_requester(request.user)
        )
        job = selectors.erasure_job_for_tenant(tenant_id=job.tenant_id)
        return Response(ErasureJobSerializer(job).data, status=status.HTTP_201_CREATED if created else 200)

    @extend_schema(
        operation_id="admin_tenant_erasure_retrieve",
        tags=["privacy"],
        responses={200: ErasureJobSerializer, **error_responses(401, 403, 404)},
        summary="The tenant's erasure job (staff)",
        examples=[ex.ERASURE_RUNNING, ex.ERASURE_COMPLETE, ex.NO_ERASURE],
        description=(
            "The tenant's erasure job: its state (pending, scheduled inside the grace window until scheduled_for, "
            "running, complete, error, cancelled), its timestamps, each node's purge (pending until the node "
            "confirms it, with the bytes it freed), and whether the signed receipt is available. The live job, "
            "else the latest cancelled one. Staff only (basic auth); a tenant key gets 403 permission_denied. "
            "Errors: 401 without credentials; 404 not_found when none was requested (or the tenant is unknown)."
        ),
    )
    def get(self, request, tenant_id):
        return Response(ErasureJobSerializer(selectors.erasure_job_for_tenant(tenant_id=tenant_id)).data)


class ErasureCancelApi(_StaffApi):
    @extend_schema(
        operation_id="admin_tenant_erasure_cancel",
        tags=["privacy"],
        request=None,
        responses={200: ErasureJobSerializer, **error_responses(401, 403, 404, 409)},
        summary="Cancel the tenant's erasure inside its grace window (staff; 409 once it runs)",
        examples=[ex.ERASURE_CANCELLED, ex.NO_ERASURE, ex.NOT_CANCELLABLE],
        description=(
            "Cancels a requested erasure while it is still pending or scheduled (inside its grace window): "
            "nothing was revoked or purged yet and the tenant is left as it was. Idempotent: cancelling a "
            "cancelled job returns it; a later request starts a new job. No body. Staff only (basic auth); a "
            "tenant key gets 403 permission_denied. Errors: 401 without credentials; 404 not_found when the tenant "
            "has no erasure job; 409 erasure_not_cancellable once the job has started (an erasure in progress "
            "cannot be undone)."
        ),
    )
    def post(self, request, tenant_id):
        job = services.erasure_cancel(tenant_id=tenant_id)
        return Response(ErasureJobSerializer(selectors.erasure_job_for_tenant(tenant_id=job.tenant_id)).data)


class ErasureReceiptApi(_StaffApi):
    @extend_schema(
        operation_id="admin_tenant_erasure_receipt",
        tags=["privacy"],
        responses={200: OpenApiTypes.OBJECT, **error_responses(401, 403, 404, 409)},
        summary="The signed deletion receipt (staff; verify offline with privacy/receipt_verify.py)",
        examples=[ex.ERASURE_RECEIPT, ex.NO_ERASURE, ex.NOT_COMPLETE],
        description=(
            "The deletion receipt of a completed erasure: what was revoked, purged (bytes freed per node and "
            "cache), shredded, deleted and pseudonymised, where and when, signed with the platform key "
            "(/.well-known/kcaas-platform-key.json) over the receipt's canonical JSON. Verify it offline with "
            "`python privacy/receipt_verify.py RECEIPT.json KEY.json`. The same receipt every time. Staff only "
            "(basic auth); a tenant key gets 403 permission_denied. Errors: 401 without credentials; 404 not_found "
            "when no erasure was requested; 409 erasure_not_complete while the job has not completed."
        ),
    )
    def get(self, request, tenant_id):
        return Response(receipt.receipt_envelope(selectors.erasure_receipt_job(tenant_id=tenant_id)))


class HoldsExportScopes(BasePermission):
    """A tenant key holding every EXPORT_SCOPES scope (403 naming the missing ones); nobody else."""

    def has_permission(self, request, view) -> bool:
        user = getattr(request, "user", None)
        if not isinstance(user, TenantPrincipal):
            return False
        missing = [s for s in EXPORT_SCOPES if not scope_rules.covers(user.scopes, [s])]
        if missing:
            raise ApplicationError(
                "A data export needs the read scope of everything it contains.",
                code="permission_denied",
                status_code=403,
                details={"required_scopes": list(EXPORT_SCOPES), "missing": missing},
            )
        return True


class TenantExportApi(APIView):
    permission_classes = [HoldsExportScopes]

    @extend_schema(
        operation_id="export_retrieve",
        tags=["privacy"],
        responses={200: OpenApiTypes.OBJECT, **error_responses(401, 403)},
        summary="Export everything held about the calling tenant as one JSON archive (GDPR Art. 20)",
        examples=[ex.EXPORT, ex.EXPORT_SCOPES_MISSING],
        description=(
            "The GDPR Art. 20 portability export of the calling key's tenant, as one machine-readable JSON "
            "document (format kcaas.tenant-export): its profile, quota (overrides and effective limits), API keys "
            "(never secrets or hashes), caches (never their hash keys), data tokens (never the tokens), today's "
            "usage, metered usage per hour and invoices, and the audit events about it. The export itself is "
            "audited (data.exported, counts only). Only a tenant key holding audit:read, caches:read, keys:read "
            "and usage:read may call it (an archive never shows more than the key could read piece by piece); "
            "staff use GET /api/v1/admin/tenants/{tenant_id}/export. Errors: 401 without a valid key; 403 "
            "permission_denied naming the missing scopes (details.missing), or for any other caller."
        ),
    )
    def get(self, request):
        return Response(export.tenant_export(tenant=request.user.tenant))


class AdminTenantExportApi(_StaffApi):
    @extend_schema(
        operation_id="admin_tenant_export_retrieve",
        tags=["privacy"],
        responses={200: OpenApiTypes.OBJECT, **error_responses(401, 403, 404)},
        summary="Export everything held about a tenant as one JSON archive (staff)",
        examples=[ex.EXPORT, ex.NO_SUCH_TENANT],
        description=(
            "The GDPR Art. 20 portability export of a tenant, for staff: its profile, quota, API keys (never "
            "secrets or hashes), caches, data tokens, usage, billing and audit events, as one machine-readable "
            "JSON document, the same archive GET /api/v1/export gives the tenant. The export itself is audited "
            "(data.exported, counts only). Staff only (basic auth); a tenant key gets 403 permission_denied. "
            "Errors: 401 without credentials; 404 not_found for an unknown tenant."
        ),
    )
    def get(self, request, tenant_id):
        return Response(export.tenant_export(tenant=tenant_get(tenant_id=tenant_id)))
