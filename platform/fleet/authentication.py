"""`Authorization: Bearer kc_node_...` -> request.user = NodePrincipal(node), request.auth = the Node.

Only tokens with the node prefix are this class's business: anything else (no header, Basic, a tenant key) gets
None so the next authenticator may try, and on node endpoints (which list only this class) the request stays
unauthenticated and IsNode refuses it with 401. A node credential that is malformed, unknown or has the wrong secret
is refused outright (401 authentication_failed) with the same message for all three.
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from fleet.credentials import credential_matches, credential_parse, is_node_credential
from fleet.principals import NodePrincipal
from fleet.selectors import node_get_by_credential

_REFUSED = "Invalid node credential."


class NodeCredentialAuthentication(BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        token = self._bearer_token(request)
        if token is None or not is_node_credential(token):
            return None
        parsed = credential_parse(token)
        if parsed is None:
            raise exceptions.AuthenticationFailed(_REFUSED)
        public_id, secret = parsed
        node = node_get_by_credential(public_id=public_id)
        if not credential_matches(secret=secret, stored_hash=node.credential_hash if node else None):
            raise exceptions.AuthenticationFailed(_REFUSED)
        return NodePrincipal(node=node), node

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="kcaas-nodes"'

    def _bearer_token(self, request) -> str | None:
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0].lower() != self.keyword.lower().encode():
            return None
        try:
            return parts[1].decode("ascii")
        except UnicodeDecodeError:
            return None


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    """Tells drf-spectacular how node endpoints authenticate."""

    target_class = NodeCredentialAuthentication
    name = "NodeCredential"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "kc_node_<public_id>_<secret><crc>",
            "description": "Node credential, issued once by staff with POST /api/v1/admin/nodes.",
        }
