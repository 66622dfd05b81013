"""How the published schema describes authentication and code samples, for every room's operations at once.

- ``AutoSchema`` (settings.REST_FRAMEWORK's DEFAULT_SCHEMA_CLASS): an operation names only the schemes that can
  succeed there. A staff-only operation (core.permissions.IsStaff, audit's StaffOnlyPermission) refuses API keys,
  so it does not list ApiKeyAuth. The session cookie is never listed (SPECTACULAR_SETTINGS' AUTHENTICATION_WHITELIST
  leaves it out): the only sign-in page is the console's, and the REST API refuses the console's sessions
  (controlplane.authentication).
- ``add_code_samples`` (a POSTPROCESSING_HOOKS entry): each operation without its own ``x-codeSamples`` gets a curl
  command (Redoc shows it beside the request and response samples), built from its method, path, credentials and
  the first request example; a paginated list's examples get a consistent page (one page, no links).
"""

from __future__ import annotations

import json
import re

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema

# Staff-only permission classes, by dotted path: importing the rooms' views here would be circular (DRF imports
# this module while it builds its first APIView).
STAFF_ONLY = frozenset({"core.permissions.IsStaff", "audit.apis.StaffOnlyPermission"})
_PATH_PARAMETER = re.compile(r"\{(\w+)\}")

# Credential flags per scheme, in the order an operation lists them (the first it accepts is the sample's).
_CURL_AUTH = {
    "ApiKeyAuth": '-H "Authorization: Bearer $KCAAS_API_KEY"',
    "NodeCredential": '-H "Authorization: Bearer $KCAAS_NODE_CREDENTIAL"',
    "basicAuth": '-u "$KCAAS_ADMIN_USER:$KCAAS_ADMIN_PASSWORD"',
}
SCHEME_DESCRIPTIONS = {
    "ApiKeyAuth": "A tenant's API key: `Authorization: Bearer kc_live_...`. Issue one with `kcaas keys create` or "
    "POST /api/v1/keys; its scopes decide which operations it may call.",
    "basicAuth": "Platform administrators only (staff without a console role), e.g. for automation. Console users "
    "are refused here: their password alone would bypass the console's second factor. A tenant operation called "
    "this way names the tenant with the `tenant_id` query parameter (`?tenant_id=...`), on every tenant-scoped "
    "operation alike.",
}


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's AutoSchema, with the security requirements narrowed to the schemes the view accepts."""

    def get_auth(self):
        auths = super().get_auth()
        permissions = self.view.get_permissions()
        if permissions and all(_dotted(type(permission)) in STAFF_ONLY for permission in permissions):
            auths = [auth for auth in auths if "ApiKeyAuth" not in auth]
        return auths


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def add_code_samples(result, generator, request, public):
    """Postprocessing hook: a curl sample on each operation that has none, and each scheme's description."""
    for name, scheme in result.get("components", {}).get("securitySchemes", {}).items():
        if name in SCHEME_DESCRIPTIONS:
            scheme["description"] = SCHEME_DESCRIPTIONS[name]
    for path, item in result.get("paths", {}).items():
        for method, operation in item.items():
            if isinstance(operation, dict) and "operationId" in operation and "x-codeSamples" not in operation:
                _single_page(operation)
                operation["x-codeSamples"] = [
                    {"lang": "Shell", "label": "curl", "source": curl(path, method, operation)}
                ]
    return result


def curl(path: str, method: str, operation: dict) -> str:
    """The curl command for one operation: $KCAAS_URL for the host, path parameters as shell variables."""
    url = "$KCAAS_URL" + _PATH_PARAMETER.sub(lambda match: "$" + match.group(1).upper(), path)
    lines = [f'curl -sS -X {method.upper()} "{url}"' if method != "get" else f'curl -sS "{url}"']
    for requirement in operation.get("security", []):
        flag = next((_CURL_AUTH[name] for name in requirement if name in _CURL_AUTH), None)
        if flag:
            lines.append(flag)
            break
    body = _request_example(operation)
    if body is not None:
        lines.append('-H "Content-Type: application/json"')
        lines.append("-d '" + json.dumps(body, indent=None).replace("'", "'\\''") + "'")
    return " \\\n  ".join(lines)


def _request_example(operation: dict):
    """The first JSON request example's value, or None (no body, or no example declared)."""
    content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    for example in content.get("examples", {}).values():
        if "value" in example:
            return example["value"]
    return None


def _single_page(operation: dict) -> None:
    """A paginated list's example is one whole page (no links), not DRF's placeholder count and links."""
    for response in operation.get("responses", {}).values():
        for media in response.get("content", {}).values():
            for example in media.get("examples", {}).values():
                page = example.get("value")
                if isinstance(page, dict) and {"count", "next", "previous", "results"} <= set(page):
                    page.update(count=len(page["results"]), previous=None, next=None)
