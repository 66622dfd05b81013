"""Gunicorn's own refusals in the project's error shape.

Gunicorn answers a request it cannot parse before Django sees it: a request line over its limit (414), too many
header fields or one too long (431), a malformed request line, header or chunk (400), an unsupported transfer coding
(501). Its answer is an HTML page (gunicorn.util.write_error), which a client of this JSON API cannot read. These
limits sit above anything a legitimate request needs (a URL of 4 KiB, 100 headers of 8 KiB each) and below what
Django could take, so they cannot be kept from clients by a lower Django-side limit; instead `install()` replaces
that writer with one answering {"error": {"code", "message", "details"}} with the same status.

controlplane.wsgi calls `install()` when gunicorn serves the application: gunicorn loads the application in each
worker before the worker serves (or in the master before forking with --preload), so every refusal a worker sends
goes through it, whatever the command line that started gunicorn.
"""

from __future__ import annotations

import json
import sys

# status -> (code, message); the message is fixed (never an echo of the refused request)
_ERRORS = {
    400: ("malformed_request", "The HTTP request is malformed."),
    403: ("permission_denied", "The request is forbidden."),
    414: ("request_line_too_long", "The request line (method, URL and version) is too long."),
    417: ("expectation_failed", "The Expect header cannot be met."),
    431: ("request_headers_too_large", "The request has too many header fields, or one too large."),
    501: ("not_implemented", "The transfer coding is not supported."),
}
_INTERNAL = ("internal_error", "An internal error occurred.")


def error_response(status_int: int, reason: str) -> bytes:
    """The whole HTTP/1.1 answer to a request gunicorn refused, with a JSON error body."""
    code, message = _ERRORS.get(status_int, _INTERNAL if status_int >= 500 else ("bad_request", "Bad request."))
    body = json.dumps({"error": {"code": code, "message": message, "details": {}}}).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\n"
        "Connection: close\r\n"
        "Content-Type: application/json\r\n"
        "Cache-Control: no-store\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("latin-1") + body


def write_json_error(sock, status_int, reason, mesg) -> None:  # gunicorn.util.write_error's signature
    from gunicorn import util

    util.write_nonblock(sock, error_response(int(status_int), str(reason)))


def install() -> bool:
    """Make gunicorn's refusals JSON, if gunicorn is what serves this process; True when installed."""
    util = sys.modules.get("gunicorn.util")
    if util is None or not hasattr(util, "write_error"):
        return False
    util.write_error = write_json_error
    return True
