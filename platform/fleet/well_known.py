"""`GET /.well-known/kcaas-ca.pem`: the platform CA certificate (public). Node certificates chain to it, so an SDK
client that trusts it can verify a node's data plane when the node serves its platform-issued certificate
(gpu_node.agent with KCAAS_NODE_TLS_FROM_IDENTITY), and a node checks its peers with it."""

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

from fleet.pki import platform_ca_pem

PEM_MEDIA_TYPE = "application/x-pem-file"


class PlatformCaApi(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema(
        operation_id="platform_ca",
        tags=["well-known"],
        auth=[],
        responses={
            (200, PEM_MEDIA_TYPE): OpenApiResponse(OpenApiTypes.STR, description="The platform CA certificate (PEM).")
        },
    )
    def get(self, request):
        response = HttpResponse(platform_ca_pem(), content_type=PEM_MEDIA_TYPE)
        response["Cache-Control"] = "public, max-age=300"
        return response
