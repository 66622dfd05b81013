"""Staff API of migration: drain a node (every cache on it migrated away, the node takes no new placements)."""

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

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
        description=(
            "Marks the node draining (no new placements) and starts one migration per ready cache on it, each to "
            "where placement puts it; the answer lists the migrations started (follow each to `done`). A cache that "
            "cannot move now (no room elsewhere, or already moving) is left on the node and logged, for a later "
            "drain. 409 invalid_node_state for a node that is not ready or cordoned."
        ),
    )
    def post(self, request, node_id):
        migrations = node_drain_caches(node_id=node_id)
        return Response({"node_id": str(node_id), "migrations": MigrationSerializer(migrations, many=True).data})
