"""The API's front door: GET /api/v1/ lists the resources and links the reference; every other unknown path under
/api/ is a JSON 404 `not_found` that points there; / sends a browser to the console and anything else here.

The listing is derived from the published OpenAPI schema (built once per process), so it names exactly the
operations the reference documents: one entry per tag (the resource), with its description, its main URL, its
methods and each operation's method, path template and summary. It needs no credentials: it reveals nothing about
any tenant, only what /api/schema/ already publishes.
"""

from __future__ import annotations

import functools
import logging

from django.conf import settings
from django.http import HttpResponsePermanentRedirect, HttpResponseRedirect, JsonResponse
from django.urls import Resolver404, resolve, reverse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.generators import SchemaGenerator

from core.errors import error_body

logger = logging.getLogger(__name__)

API_ROOT = "/api/v1/"
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


@functools.lru_cache(maxsize=1)
def _resources() -> tuple[dict, ...]:
    """The schema's operations grouped by tag, in the order the reference declares its tags (built once)."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    declared = settings.SPECTACULAR_SETTINGS["TAGS"]
    by_tag: dict[str, list[dict]] = {tag["name"]: [] for tag in declared}
    for path, item in schema["paths"].items():
        for method in HTTP_METHODS:
            operation = item.get(method)
            if operation is not None:
                by_tag[operation["tags"][0]].append(
                    {"method": method.upper(), "path": path, "summary": operation.get("summary", "")}
                )
    return tuple(_resource(tag, by_tag[tag["name"]]) for tag in declared if by_tag[tag["name"]])


def warm() -> bool:
    """Build the listing at process start (controlplane.wsgi), so the first caller does not wait for the schema; a
    failure is logged, not raised (the first GET /api/v1/ builds it then)."""
    try:
        _resources()
    except Exception:
        logger.exception("could not build the API root's listing at start-up")
        return False
    return True


def _resource(tag: dict, operations: list[dict]) -> dict:
    """One resource: its main URL is its shortest path (the collection), its methods those of every operation."""
    main = min((op["path"] for op in operations), key=lambda path: (path.count("/"), len(path)))
    methods = sorted({op["method"] for op in operations}, key=lambda m: HTTP_METHODS.index(m.lower()))
    return {
        "name": tag["name"],
        "description": tag["description"],
        "url": main,
        "methods": methods,
        "operations": operations,
    }


@csrf_exempt  # no session is read here: a POST without a CSRF token gets this answer, not a CSRF page
def api_root(request):
    """GET /api/v1/: the resources, the reference's URLs and how to authenticate; no credentials needed."""
    if request.method not in ("GET", "HEAD"):
        body = error_body("method_not_allowed", f'Method "{request.method}" not allowed.')
        return JsonResponse(body, status=405, headers={"Allow": "GET, HEAD"})
    absolute = request.build_absolute_uri
    resources = [
        {**resource, "url": absolute(resource["url"]), "operations": list(resource["operations"])}
        for resource in _resources()
    ]
    return JsonResponse(
        {
            "name": settings.SPECTACULAR_SETTINGS["TITLE"],
            "version": settings.SPECTACULAR_SETTINGS["VERSION"],
            "reference": {
                "schema_url": absolute(reverse("schema")),
                "docs_url": absolute(reverse("docs")),
                "swagger_url": absolute(reverse("docs-swagger")),
            },
            "authentication": {
                "scheme": "bearer",
                "header": "Authorization: Bearer <api key>",
                "description": "Tenant operations take an API key (kc_live_...). This listing needs none.",
            },
            "resources": resources,
        }
    )


@csrf_exempt
def api_redirect(request):
    """/api/ and /api/v1 (no slash): a permanent redirect to the API root, the method kept (308)."""
    return HttpResponsePermanentRedirect(API_ROOT, preserve_request=True)


def site_root(request):
    """/: a browser (it accepts HTML) goes to the console; an API client (curl, an SDK) to the API root."""
    accept = request.headers.get("Accept", "")
    return HttpResponseRedirect(reverse("console:overview") if "text/html" in accept else API_ROOT)


@csrf_exempt
def api_not_found(request, path: str = ""):
    """Any unknown path under /api/: 404 `not_found`, naming the API root that lists what exists (a page that
    exists with a trailing slash, like /api/docs, redirects there as APPEND_SLASH would)."""
    if not request.path.endswith("/") and _routed(request.path + "/"):
        return HttpResponsePermanentRedirect(request.get_full_path(force_append_slash=True))
    body = error_body(
        "not_found",
        f"No API resource at {request.path}. GET {API_ROOT} lists the resources.",
        {"api_root": request.build_absolute_uri(API_ROOT)},
    )
    return JsonResponse(body, status=404)


def _routed(path: str) -> bool:
    """Whether path resolves to a view other than this catch-all."""
    try:
        return resolve(path).func is not api_not_found
    except Resolver404:
        return False
