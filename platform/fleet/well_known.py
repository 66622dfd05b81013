"""`GET /.well-known/kcaas-ca.pem`: the platform CA certificate (public). Node certificates chain to it, so an SDK
client that trusts it can verify a node's data plane when the node serves its platform-issued certificate
(gpu_node.agent.process with KCAAS_NODE_TLS_FROM_IDENTITY), and a node checks its peers with it.

When settings.KCAAS_DATA_PLANE_CA_FILE names a readable PEM certificate (`make up`'s dev CA, which signs its agents'
data-plane certificates, or an operator's own), it follows the platform CA in the same answer: one bundle, so
`kcaas.connect()` trusts a node whichever of the two issued its certificate."""

import logging
from pathlib import Path

from django.conf import settings
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

from fleet import api_examples
from fleet.pki import platform_ca_pem

PEM_MEDIA_TYPE = "application/x-pem-file"
MAX_CA_FILE_BYTES = 32 * 1024
logger = logging.getLogger(__name__)


class PlatformCaApi(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema(
        operation_id="platform_ca",
        summary="The platform CA certificate (PEM)",
        tags=["well-known"],
        auth=[],
        examples=[api_examples.PLATFORM_CA],
        responses={
            (200, PEM_MEDIA_TYPE): OpenApiResponse(
                OpenApiTypes.STR,
                description="The platform CA certificate, then the data-plane CA when one is configured (PEM).",
            )
        },
        description=(
            "The platform CA certificate (PEM) that signs node certificates, followed by the data-plane CA when "
            "one is configured: what an SDK or engine trusts for the TLS 1.3 data plane and what node agents "
            "trust for migration's mutual TLS. Public: anyone may call it, with no credentials and no rate limit; "
            "cacheable for five minutes. It has no error answers of its own."
        ),
    )
    def get(self, request):
        response = HttpResponse(ca_bundle_pem(), content_type=PEM_MEDIA_TYPE)
        response["Cache-Control"] = "public, max-age=300"
        return response


def ca_bundle_pem() -> str:
    """The platform CA, then the data-plane CA file's certificate(s) when configured, readable and not the same."""
    bundle = platform_ca_pem()
    extra = data_plane_ca_pem()
    if extra and extra.strip() != bundle.strip():
        bundle = bundle.rstrip("\n") + "\n" + extra.strip() + "\n"
    return bundle


def data_plane_ca_pem() -> str:
    """The PEM of settings.KCAAS_DATA_PLANE_CA_FILE, "" when unset, missing or not a certificate (logged)."""
    name = getattr(settings, "KCAAS_DATA_PLANE_CA_FILE", "")
    if not name:
        return ""
    try:
        data = Path(name).read_bytes()[: MAX_CA_FILE_BYTES + 1]
    except FileNotFoundError:
        return ""
    except OSError as error:
        logger.warning("data-plane CA file %s is unreadable: %s", name, error)
        return ""
    if len(data) > MAX_CA_FILE_BYTES or b"-----BEGIN CERTIFICATE-----" not in data or b"PRIVATE KEY" in data:
        logger.warning("data-plane CA file %s is not a PEM certificate (of at most %d bytes)", name, MAX_CA_FILE_BYTES)
        return ""
    return data.decode("ascii", errors="replace")
