"""REST API of recovery: POST caches/{id}/recover re-places a cache whose node was lost (caches.recovery)."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from caches import api_examples as ex
from caches.apis import CacheOutputSerializer, _tenant_scope
from caches.recovery import cache_recover
from core.openapi import AUTH_ERRORS, RATE_LIMIT_HEADERS, error_responses
from core.permissions import ScopePermission


class CacheRecoverApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="caches_recover",
        summary="Recover a cache from the network tier after its node was lost",
        examples=[ex.RECOVERING],
        tags=["caches"],
        request=None,
        parameters=RATE_LIMIT_HEADERS,
        responses={
            202: OpenApiResponse(CacheOutputSerializer, description="Re-placed: provisioning on another node."),
            **error_responses(*AUTH_ERRORS, 404, 409, 503),
        },
        description="Recover a cache whose node was lost (`failed`, failure_reason `node_lost`) from the fleet's "
        "network tier: it is placed on another node at a new epoch and provisioned there (returned `provisioning`; "
        "`ready` when the node answers); that node finds the blocks the cache stored in the network store. On "
        "request only: the tenant decides whether re-creating it is worth it. 409 cache_not_node_lost, "
        "cache_without_network_tier, network_tier_absent or tenant_inactive; 503 no_capacity. Another tenant's "
        "cache is a 404. Needs caches:write; audited (cache_recovered).",
    )
    def post(self, request, cache_id):
        cache = cache_recover(cache_id=cache_id, tenant_id=_tenant_scope(request, None))
        return Response(CacheOutputSerializer(cache).data, status=status.HTTP_202_ACCEPTED)
