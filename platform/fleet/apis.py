"""Fleet REST views. Each validates its input, calls one service or selector, and serializes the result.

Bodies are JSON only. Node endpoints (`nodes/register`, `nodes/heartbeat`) authenticate with the node credential
only and admit only node principals; they are not rate limited per tenant. Admin endpoints use the project's default
authenticators (tenant keys, sessions, basic) and admit staff only, so a tenant key gets 403 and a node credential
401.
"""

from django.conf import settings
from django.utils.module_loading import import_string
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer, inline_serializer
from rest_framework import serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.openapi import error_responses
from core.permissions import IsStaff
from fleet import api_examples as ex
from fleet import selectors, services
from fleet.authentication import NodeCredentialAuthentication
from fleet.models import NodeState
from fleet.permissions import IsNode
from fleet.pki import MAX_CSR_BYTES
from fleet.serializers import (
    NodeDetailSerializer,
    NodeSerializer,
    ResidentCacheSerializer,
    TierBytesSerializer,
)
from fleet.validators import MAX_ENDPOINT_LENGTH, NODE_NAME_RE, endpoint_error

MAX_RESIDENT_ENTRIES = 10_000  # caches one node may report in a heartbeat


def _validate_endpoint(value: str) -> str:
    problem = endpoint_error(value)
    if problem:
        raise serializers.ValidationError(problem)
    return value


# ---- node agents ----------------------------------------------------------------------------------------------------


def _csr_field(*, required: bool) -> serializers.CharField:
    return serializers.CharField(
        required=required,
        max_length=MAX_CSR_BYTES,
        trim_whitespace=False,
        help_text="PEM PKCS#10 request for the node's own ECDSA P-256 key; only the key is used (fleet.pki)",
    )


@extend_schema_serializer(component_name="RevokedToken")
class RevokedTokenSerializer(serializers.Serializer):
    """A data token revoked before its expiry: the node refuses it until `exp` (unix seconds) has passed."""

    jti = serializers.CharField()
    exp = serializers.IntegerField()


class _NodeApi(APIView):
    authentication_classes = [NodeCredentialAuthentication]
    parser_classes = [JSONParser]
    permission_classes = [IsNode]
    throttle_classes: list = []


class NodeRegisterApi(_NodeApi):
    @extend_schema_serializer(component_name="NodeRegister")
    class InputSerializer(serializers.Serializer):
        endpoint = serializers.CharField(
            max_length=MAX_ENDPOINT_LENGTH, trim_whitespace=False, validators=[_validate_endpoint]
        )
        capacity = TierBytesSerializer()
        caches = serializers.ListField(
            child=serializers.UUIDField(),
            required=False,
            default=list,
            max_length=10_000,
            help_text="ids of the caches the agent still holds (after a restart: usually none)",
        )
        csr = _csr_field(required=False)
        sealing_public_key = serializers.CharField(
            required=False,
            max_length=64,
            trim_whitespace=False,
            help_text="base64 of the node's X25519 public key (32 bytes): the keys in its provisioning and migration "
            "orders are sealed to it (kcaas/node_protocol/sealing.py). Without one the node is sent no keys, so it "
            "cannot host caches.",
        )

    @extend_schema_serializer(component_name="NodeRegistration")
    class OutputSerializer(serializers.Serializer):
        node = NodeSerializer()
        heartbeat_interval_seconds = serializers.IntegerField()
        lease_seconds = serializers.IntegerField()
        caches = serializers.ListField(
            child=serializers.DictField(),
            help_text="caches the control plane believes this node hosts (cache_id, epoch, state, capacity); those "
            "the agent no longer holds are being provisioned again (state provisioning)",
        )
        revoked_tokens = RevokedTokenSerializer(many=True)
        stored_caches = serializers.ListField(
            child=serializers.CharField(),
            help_text="ids of the caches whose blocks this node may keep on disk (placed on it, or being migrated to "
            "it); the agent deletes the SSD directories of every other cache",
        )
        certificate = serializers.CharField(
            required=False, help_text="PEM node certificate (spiffe://kcaas/node/<id>); only when a csr was sent"
        )
        ca_certificate = serializers.CharField(required=False, help_text="PEM platform CA; only with certificate")

    @extend_schema(
        operation_id="nodes_register",
        tags=["nodes"],
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(400, 401, 409)},
        summary="Register (or re-register after a restart) the calling node agent",
        examples=[ex.REGISTER_REQUEST, ex.REGISTERED, ex.CSR_REFUSED],
        description=(
            "Called by a node agent at start-up and after every restart, with its node credential: records its "
            "endpoint and capacity, renews its lease, and (with a csr) issues its certificate from the platform "
            "CA. The answer lists the caches the control plane believes it hosts; those it no longer holds (not "
            "named in `caches` of the request) are provisioned again, empty, and marked emptied. Also: revoked "
            "tokens and the caches whose SSD blocks it may keep. Only a node credential (`Bearer kc_node_...`, "
            "issued by POST /api/v1/admin/nodes) is accepted: anything else is 401. Errors: 400 validation_error, "
            "invalid_sealing_key, or csr_malformed | csr_signature_invalid | csr_key_unsupported (a bad CSR "
            "refuses the whole registration); 401 for a missing, unknown or revoked credential; 409 "
            "endpoint_in_use when another live node answers on the endpoint."
        ),
    )
    def post(self, request):
        data = _validated(self.InputSerializer, request.data)
        registration = services.node_register(
            node_id=request.user.node.pk,
            endpoint=data["endpoint"],
            capacity=dict(data["capacity"]),
            csr=data.get("csr"),
            sealing_public_key=data.get("sealing_public_key"),
        )
        body = {
            "node": registration.node,
            "heartbeat_interval_seconds": settings.KCAAS_NODE_HEARTBEAT_SECONDS,
            "lease_seconds": settings.KCAAS_NODE_LEASE_SECONDS,
            "caches": import_string(settings.KCAAS_NODE_REGISTER_RECONCILER)(
                node_id=registration.node.pk, held_cache_ids=data.get("caches", [])
            ),
            "revoked_tokens": _revoked_tokens(registration.node.pk),
            "stored_caches": import_string(settings.KCAAS_NODE_STORED_CACHES)(node_id=registration.node.pk),
        }
        if registration.certificate is not None:
            body.update(certificate=registration.certificate, ca_certificate=registration.ca_certificate)
        _run_register_hooks(registration.node.pk)
        return Response(self.OutputSerializer(body).data)


class NodeHeartbeatApi(_NodeApi):
    @extend_schema_serializer(component_name="NodeHeartbeat")
    class InputSerializer(serializers.Serializer):
        capacity = TierBytesSerializer()
        resident = ResidentCacheSerializer(many=True, required=False, max_length=MAX_RESIDENT_ENTRIES)

        def validate_resident(self, entries):
            ids = [entry["cache_id"] for entry in entries]
            if len(ids) != len(set(ids)):
                raise serializers.ValidationError("each cache_id may appear once")
            return entries

    @extend_schema_serializer(component_name="NodeHeartbeatAck")
    class OutputSerializer(serializers.Serializer):
        state = serializers.ChoiceField(choices=NodeState.choices)
        lease_expires_at = serializers.DateTimeField()
        heartbeat_interval_seconds = serializers.IntegerField()
        revoked_tokens = RevokedTokenSerializer(many=True)

    @extend_schema(
        operation_id="nodes_heartbeat",
        tags=["nodes"],
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(400, 401, 409)},
        summary="Renew the calling node's lease; report capacity and resident bytes per cache",
        examples=[ex.HEARTBEAT_REQUEST, ex.HEARTBEAT_ACK, ex.REREGISTER_REQUIRED],
        description=(
            "Called by a node agent every heartbeat_interval_seconds with its node credential: renews its lease "
            "(a node whose lease passes is marked lost and its caches re-placed), records its capacity and, when "
            "`resident` is sent, the absolute resident bytes per cache (which replace the previous snapshot; a "
            "ready cache the node no longer reports is provisioned again). The answer carries the data tokens "
            "revoked on its caches, which it must refuse until their exp. Errors: 400 validation_error; 401 for "
            "anything but a valid node credential; 409 reregister_required for a lost or never-registered node, "
            "which must call register again."
        ),
    )
    def post(self, request):
        data = _validated(self.InputSerializer, request.data)
        node = services.node_heartbeat(
            node_id=request.user.node.pk, capacity=dict(data["capacity"]), resident=data.get("resident")
        )
        if data.get("resident") is not None:  # the caches room re-provisions a ready cache the node no longer holds
            import_string(settings.KCAAS_NODE_HEARTBEAT_RECONCILER)(
                node_id=node.pk, resident_cache_ids=[entry["cache_id"] for entry in data["resident"]]
            )
        body = {
            "state": node.state,
            "lease_expires_at": node.lease_expires_at,
            "heartbeat_interval_seconds": settings.KCAAS_NODE_HEARTBEAT_SECONDS,
            "revoked_tokens": _revoked_tokens(node.pk),
        }
        return Response(self.OutputSerializer(body).data)


class NodeCertificateApi(_NodeApi):
    @extend_schema_serializer(component_name="NodeCertificateRequest")
    class InputSerializer(serializers.Serializer):
        csr = _csr_field(required=True)

    @extend_schema_serializer(component_name="NodeCertificate")
    class OutputSerializer(serializers.Serializer):
        certificate = serializers.CharField(help_text="PEM node certificate (spiffe://kcaas/node/<id>)")
        ca_certificate = serializers.CharField(help_text="PEM platform CA certificate")

    @extend_schema(
        operation_id="nodes_certificate_renew",
        tags=["nodes"],
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(400, 401, 409)},
        summary="Renew the calling node's certificate from a fresh CSR",
        examples=[ex.RENEW_REQUEST, ex.RENEWED, ex.CSR_REFUSED, ex.RENEWAL_REREGISTER_REQUIRED],
        description=(
            "Called by a node agent, with its node credential, at half of its certificate's lifetime "
            "(KCAAS_NODE_CERT_HOURS, 12 hours by default): a new certificate from the platform CA for the ECDSA "
            "P-256 key of the CSR, naming spiffe://kcaas/node/<id> and the node's endpoint (nothing else of the "
            "CSR is used), and the CA certificate. Audited (node.certificate_issued). Errors: 400 csr_malformed | "
            "csr_signature_invalid | csr_key_unsupported; 401 for anything but a valid node credential; 409 "
            "reregister_required for a lost or never-registered node."
        ),
    )
    def post(self, request):
        data = _validated(self.InputSerializer, request.data)
        issued = services.node_certificate_renew(node_id=request.user.node.pk, csr=data["csr"])
        body = {"certificate": issued.certificate, "ca_certificate": issued.ca_certificate}
        return Response(self.OutputSerializer(body).data)


def _run_register_hooks(node_id) -> None:
    """The upper rooms' reactions to a (re-)registration (settings.KCAAS_NODE_REGISTER_HOOKS, dotted paths called
    with node_id=...), e.g. privacy resending pending erasure purges to a node that was lost."""
    for hook in getattr(settings, "KCAAS_NODE_REGISTER_HOOKS", ()):
        import_string(hook)(node_id=node_id)


def _revoked_tokens(node_id) -> list[dict]:
    return import_string(settings.KCAAS_NODE_REVOKED_TOKENS)(node_id=node_id)


def _validated(serializer_class, data) -> dict:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# ---- staff ----------------------------------------------------------------------------------------------------------


class _AdminApi(APIView):
    permission_classes = [IsStaff]
    parser_classes = [JSONParser]


class AdminNodesApi(_AdminApi):
    """GET lists nodes, POST creates one and returns its credential once."""

    @extend_schema_serializer(component_name="NodeListFilter")
    class FilterSerializer(serializers.Serializer):
        state = serializers.ChoiceField(choices=NodeState.choices, required=False)

    @extend_schema_serializer(component_name="NodeCreate")
    class InputSerializer(serializers.Serializer):
        name = serializers.RegexField(NODE_NAME_RE, max_length=100)

    @extend_schema_serializer(component_name="NodeCreated")
    class OutputSerializer(serializers.Serializer):
        node = NodeSerializer()
        credential = serializers.CharField(help_text="kc_node_... shown once; only its hash is stored")

    PageSerializer = inline_serializer(
        name="PaginatedNodeList",
        fields={
            "count": serializers.IntegerField(),
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": NodeSerializer(many=True),
        },
    )

    @extend_schema(
        operation_id="admin_nodes_list",
        tags=["admin"],
        parameters=[
            FilterSerializer,
            OpenApiParameter("limit", int, description="page size"),
            OpenApiParameter("offset", int, description="index of the first node"),
        ],
        responses={200: PageSerializer, **error_responses(400, 401, 403)},
        summary="List nodes (staff)",
        examples=[ex.NODE_LIST],
    )
    def get(self, request):
        filters = _validated(self.FilterSerializer, request.query_params)
        paginator = LimitOffsetPagination()
        page = paginator.paginate_queryset(selectors.node_list(**filters), request, view=self)
        return paginator.get_paginated_response(NodeSerializer(page, many=True).data)

    @extend_schema(
        operation_id="admin_nodes_create",
        tags=["admin"],
        request=InputSerializer,
        responses={201: OutputSerializer, **error_responses(400, 401, 403, 409)},
        summary="Create a node and issue its credential (staff)",
        examples=[ex.NODE_CREATE, ex.NODE_CREATED],
    )
    def post(self, request):
        data = _validated(self.InputSerializer, request.data)
        issued = services.node_create(name=data["name"])
        body = {"node": issued.node, "credential": issued.credential}
        return Response(self.OutputSerializer(body).data, status=status.HTTP_201_CREATED)


class AdminNodeDetailApi(_AdminApi):
    @extend_schema(
        operation_id="admin_nodes_retrieve",
        tags=["admin"],
        responses={200: NodeDetailSerializer, **error_responses(401, 403, 404)},
        summary="One node with its latest resident-bytes snapshot (staff)",
        examples=[ex.NODE_DETAIL],
        description=(
            "One node: state, endpoint, lease, capacity, reserved and free bytes per tier, and the resident-bytes "
            "snapshot of its last heartbeat (bytes per tier per cache it hosts). 404 for an unknown id."
        ),
    )
    def get(self, request, node_id):
        return Response(NodeDetailSerializer(selectors.node_get(node_id=node_id)).data)


class AdminNodeCordonApi(_AdminApi):
    @extend_schema(
        operation_id="admin_nodes_cordon",
        tags=["admin"],
        request=None,
        responses={200: NodeSerializer, **error_responses(401, 403, 404, 409)},
        summary="Cordon a ready node: no new placements, its caches stay (staff; idempotent)",
        examples=[ex.NODE_CORDONED],
        description=(
            "Stops new placements on a ready (or draining) node; the caches already on it stay and keep serving. "
            "Idempotent: cordoning a cordoned node changes nothing and writes no audit event. 409 "
            "invalid_node_state for a lost or registering node. Undo with uncordon."
        ),
    )
    def post(self, request, node_id):
        return Response(NodeSerializer(services.node_cordon(node_id=node_id)).data)


class AdminNodeUncordonApi(_AdminApi):
    @extend_schema(
        operation_id="admin_nodes_uncordon",
        tags=["admin"],
        request=None,
        responses={200: NodeSerializer, **error_responses(401, 403, 404, 409)},
        summary="Return a cordoned or draining node to ready (staff; idempotent)",
        examples=[ex.NODE_UNCORDONED],
        description=(
            "Returns a cordoned or draining node to `ready`, so placement may choose it again; caches already "
            "migrated away stay where they are. Idempotent on a ready node; 409 invalid_node_state for a lost or "
            "registering node."
        ),
    )
    def post(self, request, node_id):
        return Response(NodeSerializer(services.node_uncordon(node_id=node_id)).data)
