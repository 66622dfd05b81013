"""Limits on what a request may carry, and the cache policy of API answers, for every route (DRF views, plain views,
the console) before any of them runs.

`RequestLimits` answers, in the project's error shape, before the body reaches a parser:
- a body larger than settings.KCAAS_MAX_REQUEST_BYTES (by its Content-Length, so nothing of it is read): 413
  `request_too_large` (details.max_bytes). Django's own limit (DATA_UPLOAD_MAX_MEMORY_SIZE) is the same number, and
  a RequestDataTooBig raised anyway (a body read elsewhere) is the same 413 (core.errors);
- a body sent chunked, without a Content-Length: 411 `length_required` (Django reads such a body as empty: a JSON
  request would otherwise be taken for an empty one);
- a JSON body nested deeper than settings.KCAAS_MAX_JSON_DEPTH: 400 `json_too_deep` (details.max_depth). Python's
  JSON decoder recurses, so a body nested ~1,000 deep raised RecursionError (a 500), and one just below that limit
  parsed but could raise it later in any code walking the data; no operation's body is deeper than 3.
  The check costs nothing for ordinary bodies (fewer opening brackets than the limit, counted in C); others are
  scanned once, strings skipped (bench.controlplane measures request handling).

Gunicorn refuses what it cannot parse (a request line over 4094 bytes, more than 100 header fields or one over 8190
bytes, a malformed request) before Django sees it; controlplane.gunicorn_errors makes those answers the same error
shape.

`RequestLimits` also marks every answer under /api/ `Cache-Control: no-store` unless the view chose its own policy:
API answers are per caller, and some carry a secret shown once (an API key when issued or rotated, a node credential,
a data-plane token) that no browser or proxy cache may keep.
"""

from __future__ import annotations

import itertools
import re
from array import array

from django.conf import settings
from django.http import JsonResponse, UnreadablePostError

from core.errors import error_body

API_PREFIX = "/api/"
NO_STORE = "no-store"

_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')  # a JSON string literal; possessive: linear time
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests arrays and objects (brackets inside strings do not count). Meant for texts that
    may be malformed: it never raises, and a malformed text's answer only bounds what a parser would build."""
    steps = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_BRACKET_STEPS)
    return max(itertools.accumulate(array("b", steps)), default=0)


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _refusal(status: int, code: str, message: str, details: dict) -> JsonResponse:
    response = JsonResponse(error_body(code, message, details), status=status)
    response["Content-Length"] = str(len(response.content))  # a client still sending can read the answer whole
    return response


class RequestLimits:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self._refused(request) or self.get_response(request)
        if request.path.startswith(API_PREFIX) and not response.has_header("Cache-Control"):
            response["Cache-Control"] = NO_STORE
        return response

    def _refused(self, request) -> JsonResponse | None:
        meta = request.META
        try:
            length = int(meta.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if length < 0:
            return _refusal(400, "malformed_request", "The Content-Length header is not a byte count.", {})
        limit = settings.KCAAS_MAX_REQUEST_BYTES
        if length > limit:
            return _refusal(413, "request_too_large", f"The request body exceeds {limit} bytes.", {"max_bytes": limit})
        if not length:
            if "chunked" in meta.get("HTTP_TRANSFER_ENCODING", "").lower():
                return _refusal(411, "length_required", "Send the body with a Content-Length, not chunked.", {})
            return None
        if not _is_json(meta.get("CONTENT_TYPE", "")):
            return None
        try:
            body = request.body  # at most KCAAS_MAX_REQUEST_BYTES (checked above); parsers read this copy
        except UnreadablePostError:  # the client went away mid-body: nobody is left to read an answer
            return _refusal(400, "malformed_request", "The request body could not be read.", {})
        limit = settings.KCAAS_MAX_JSON_DEPTH
        if body.count(b"[") + body.count(b"{") > limit and json_depth(body) > limit:
            return _refusal(
                400, "json_too_deep", f"The JSON body nests more than {limit} levels.", {"max_depth": limit}
            )
        return None
