"""Staff API of migration: drain a node (every cache on it migrated away, the node takes no new placements)."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from caches import api_examples
from caches.migration import node_drain_caches
from core.openapi import error_responses
from core.permissions import IsStaff


class MigrationSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    cache_id = serializers.UUIDField()
    source_id = serializers.UUIDField()
    target_id = serializers.UUIDField()
    epoch_from = serializers.IntegerField()
    epoch_to = serializers.IntegerField()
    reason = serializers.CharField()
    state = serializers.CharField()


class AdminNodeDrainApi(APIView):
    permission_classes = [IsStaff]
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="admin_nodes_drain",
        tags=["admin"],
        request=None,
        responses={
            200: inline_serializer(
                name="NodeDrained",
                fields={"node_id": serializers.UUIDField(), "migrations": MigrationSerializer(many=True)},
            ),
            **error_responses(401, 403, 404, 409),
        },
        summary="Drain a node: no new placements, every ready cache on it migrated away (staff; audited)",
        examples=[api_examples.NODE_DRAINED, api_examples.NODE_UNKNOWN, api_examples.NODE_NOT_DRAINABLE],
        description=(
            "Marks the node draining (no new placements; audited node.draining) and starts one migration per ready "
            "cache on it, each to where placement puts it, at the cache's next epoch; the answer lists the "
            "migrations started, in state `pending` (each ends `complete`, its cache then served by the target, "
            "or `failed`, its cache staying put). A cache that cannot move now (no room elsewhere, or already "
            "moving) is left on the node and logged: drain again later (draining a draining node is allowed and "
            "starts only the missing migrations). Staff only (basic auth); a tenant key gets 403. Errors: 404 "
            "not_found for an unknown node; 409 invalid_node_state for a node that is not ready, cordoned or "
            "draining (lost, registering). Uncordon returns it to ready; migrations already started go on."
        ),
    )
    def post(self, request, node_id):
        migrations = node_drain_caches(node_id=node_id)
        return Response({"node_id": str(node_id), "migrations": MigrationSerializer(migrations, many=True).data})
