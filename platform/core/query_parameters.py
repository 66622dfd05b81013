"""Undocumented query parameters are refused, as unknown body fields are: the published OpenAPI schema is the
contract, so `GET /api/v1/keys?limt=5` (a typo) is a 400 naming `limt`, not a silently ignored filter.

`RejectUndocumentedQueryParameters` (middleware) looks up the resolved route and method in the schema that
drf-spectacular publishes and answers 400 `validation_error` with `details.fields.<name>` for every query parameter
the operation does not declare. Routes outside /api/v1/ and operations the schema does not publish are left alone.

The table is built once per process: at start-up (`warm()`, called by controlplane/wsgi.py), else on first use.
Building it is not thread-safe (drf-spectacular loads its extensions lazily, and concurrent first builds see
half-loaded ones), so it is built under a lock, double-checked: at most one build runs at a time, a finished table
is never rebuilt, and a failed build leaves nothing behind (the next request tries again).
"""

from __future__ import annotations

import logging
import re
import threading

from django.http import JsonResponse

from core.errors import error_body

API_PREFIX = "/api/v1/"
_CONVERTER = re.compile(r"<(?:\w+:)?(\w+)>")


def schema_path(route: str) -> str:
    """Django's route "api/v1/caches/<uuid:cache_id>" -> the schema's "/api/v1/caches/{cache_id}"."""
    return "/" + _CONVERTER.sub(r"{\1}", route)


logger = logging.getLogger("kcaas.query_parameters")
_table: dict[tuple[str, str], frozenset[str]] | None = None
_table_lock = threading.Lock()


def documented_query_parameters() -> dict[tuple[str, str], frozenset[str]]:
    """(schema path, METHOD) -> the query parameter names that operation declares; built once, under the lock."""
    global _table
    table = _table
    if table is None:
        with _table_lock:
            if _table is None:
                _table = _build_table()
            table = _table
    return table


def warm() -> bool:
    """Build the table now (process start), so no request pays for it or races for it. A failure is logged, not
    raised: the process still serves, and the first request that needs the table builds it (or answers 500)."""
    try:
        documented_query_parameters()
    except Exception:
        logger.exception("could not build the query-parameter table at start-up")
        return False
    return True


def _build_table() -> dict[tuple[str, str], frozenset[str]]:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    documented = {}
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict):
                continue
            names = {p["name"] for p in operation.get("parameters", []) if p.get("in") == "query"}
            documented[(path, method.upper())] = frozenset(names)
    return documented


class RejectUndocumentedQueryParameters:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        if not request.path.startswith(API_PREFIX) or not request.GET or request.resolver_match is None:
            return None
        allowed = documented_query_parameters().get((schema_path(request.resolver_match.route), request.method))
        if allowed is None:
            return None
        unknown = sorted(set(request.GET.keys()) - allowed)
        if not unknown:
            return None
        fields = {name: ["Unknown query parameter."] for name in unknown}
        return JsonResponse(error_body("validation_error", "The request is invalid.", {"fields": fields}), status=400)
