"""One error shape everywhere: {"error": {"code": "...", "message": "...", "details": {...}}}.

Services raise ApplicationError (or a subclass) with a machine-readable code; DRF's own exceptions are mapped to the
same shape; anything unexpected is logged and answered as a 500 `internal_error` without internals.

An outage of a backing service is not a bug: a connection-level database error (django.db OperationalError or
InterfaceError: PostgreSQL restarting or stopped, SQLite's "database is locked") is a 503 `database_unavailable`,
a broker or Redis connection error (kombu's OperationalError, redis' ConnectionError/TimeoutError) a 503
`broker_unavailable`, both with `Retry-After: 2`. The same answer comes from DRF views (`exception_handler`) and
from everything outside them, middleware included (`json_500`, Django's handler500, which inspects the exception
being handled). Neither path touches the database. A DRF view's own atomic blocks have been rolled back (or their
connection dropped) by the time the handler sees the exception; request-wide ones are marked for rollback.

Requests Django itself finds suspicious are the client's fault, never a 500, wherever they are raised: a body over
DATA_UPLOAD_MAX_MEMORY_SIZE is 413 `request_too_large` (controlplane.middleware refuses most of them before a body is
read), too many form or query fields 400 `too_many_fields`, anything else of the kind 400 `bad_request`.
"""

import logging
import sys

from django.conf import settings
from django.core.exceptions import (
    PermissionDenied as DjangoPermissionDenied,
)
from django.core.exceptions import (
    RequestDataTooBig,
    SuspiciousOperation,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

from core.transient import TRANSIENT_BROKER_ERRORS, TRANSIENT_DATABASE_ERRORS

logger = logging.getLogger("kcaas.errors")


class ApplicationError(Exception):
    """A refusal a client can act on: HTTP status, stable code, message, optional details."""

    status_code = status.HTTP_400_BAD_REQUEST
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, details: dict | None = None, status_code=None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.details = details or {}
        self.status_code = status_code or self.status_code


class NotFoundError(ApplicationError):
    status_code = status.HTTP_404_NOT_FOUND
    code = "not_found"


class ConflictError(ApplicationError):
    status_code = status.HTTP_409_CONFLICT
    code = "conflict"


class QuotaExceeded(ApplicationError):
    status_code = status.HTTP_403_FORBIDDEN
    code = "quota_exceeded"


class TransientError(ApplicationError):
    """Something the change needs is unavailable right now and the change was rolled back: 503 with Retry-After and a
    fixed public message (the cause, this exception's own message, stays in the log). A room raises a subclass (the
    audit trail's AuditWriteError is one), so this layer knows no room; node answers retry on it
    (core.node_answers.node_answer_retry)."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    code = "unavailable"
    public_message = "A service the change needs is unavailable; nothing was changed. Retry later."
    retry_after_seconds = 5


def error_body(code: str, message: str, details: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, "details": details or {}}}


_DRF_CODES = {
    exceptions.ValidationError: "validation_error",
    exceptions.ParseError: "malformed_request",
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "authentication_failed",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "rate_limited",
}


def transient_body(exc: TransientError) -> dict:
    """The answer to a change refused by a TransientError (it was rolled back): its code and public message only."""
    return error_body(exc.code, exc.public_message)


RETRY_AFTER_SECONDS = 2  # what a 503 for an outage asks clients to wait: restarts take seconds
DATABASE_UNAVAILABLE = "database_unavailable"
BROKER_UNAVAILABLE = "broker_unavailable"
_UNAVAILABLE_MESSAGES = {
    DATABASE_UNAVAILABLE: "The database is unavailable; retry later.",
    BROKER_UNAVAILABLE: "The message broker is unavailable; retry later.",
}


def unavailable_code(exc: BaseException | None) -> str | None:
    """`database_unavailable` or `broker_unavailable` when `exc` (or an exception it was explicitly raised from)
    is a backing service's connection-level error, else None (a bug or a refusal: answered as before)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TRANSIENT_DATABASE_ERRORS):
            return DATABASE_UNAVAILABLE
        if isinstance(exc, TRANSIENT_BROKER_ERRORS):
            return BROKER_UNAVAILABLE
        exc, seen = exc.__cause__, seen + 1
    return None


def _unavailable(response, code: str, exc: BaseException, where: str):
    """Fill in a 503 for an outage; the cause goes to the log (a warning: retrying is the remedy), not the body."""
    logger.warning("%s in %s: %s: %s", code, where, type(exc).__name__, str(exc).strip()[:500])
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


def suspicious_body(exc: SuspiciousOperation) -> tuple[dict, int]:
    """The answer (body, status) to a request Django refused as suspicious: never a 500."""
    if isinstance(exc, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return error_body("request_too_large", f"The request body exceeds {limit} bytes.", {"max_bytes": limit}), 413
    if isinstance(exc, TooManyFieldsSent | TooManyFilesSent):
        return error_body("too_many_fields", "The request has too many fields."), 400
    return error_body("bad_request", "Bad request."), 400


def exception_handler(exc, context):
    if isinstance(exc, SuspiciousOperation):
        body, status_code = suspicious_body(exc)
        return Response(body, status=status_code)

    if isinstance(exc, TransientError):
        logger.error("refused %s: %s", context.get("view").__class__.__name__, exc)  # the cause stays in the log
        response = Response(transient_body(exc), status=exc.status_code)
        response["Retry-After"] = str(exc.retry_after_seconds)
        return response
    if isinstance(exc, ApplicationError):
        response = Response(error_body(exc.code, exc.message, exc.details), status=exc.status_code)
        for name, value in (getattr(exc, "headers", None) or {}).items():
            response[name] = value
        return response
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.APIException):
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), "error")
        if isinstance(exc, exceptions.ValidationError):
            details = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
            body = error_body(code, "The request is invalid.", {"fields": details})
        else:
            body = error_body(code, str(exc.detail))
        response = Response(body, status=exc.status_code)
        if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
            response["WWW-Authenticate"] = 'Bearer realm="kcaas"'
            response.status_code = status.HTTP_401_UNAUTHORIZED
        headers = getattr(exc, "headers", None) or {}
        for name, value in headers.items():
            response[name] = value
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            response["Retry-After"] = str(max(1, int(-(-exc.wait // 1))))
        return response
    return _unexpected(exc, context)


def _unexpected(exc, context):
    """What would be a 500: a backing service's outage is a 503 instead, anything else stays a 500 (logged)."""
    from rest_framework.views import set_rollback

    code = unavailable_code(exc)
    if code is not None:
        set_rollback()  # a request-wide atomic block (ATOMIC_REQUESTS) must not try to commit
        response = Response(error_body(code, _UNAVAILABLE_MESSAGES[code]), status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return _unavailable(response, code, exc, context.get("view").__class__.__name__)
    logger.exception("unhandled error in %s", context.get("view"))
    return Response(error_body("internal_error", "An internal error occurred."), status=500)


def json_404(request, exception=None):
    return JsonResponse(error_body("not_found", "No such resource."), status=404)


def json_500(request):
    """Django's handler500: errors outside DRF views (middleware, plain views). An outage of a backing service is
    the same 503 as in the API; anything else a 500. Never touches the database (nor request.user/session)."""
    exc = sys.exc_info()[1]
    code = unavailable_code(exc)
    if code is not None:
        response = JsonResponse(error_body(code, _UNAVAILABLE_MESSAGES[code]), status=503)
        return _unavailable(response, code, exc, request.path)
    return JsonResponse(error_body("internal_error", "An internal error occurred."), status=500)


def json_400(request, exception=None):
    """Django's handler400: a SuspiciousOperation outside DRF views (a too-large body read by a plain view, too many
    query fields seen by a middleware)."""
    if isinstance(exception, SuspiciousOperation):
        body, status_code = suspicious_body(exception)
        return JsonResponse(body, status=status_code)
    return JsonResponse(error_body("bad_request", "Bad request."), status=400)


def json_403(request, exception=None):
    return JsonResponse(error_body("permission_denied", "Forbidden."), status=403)
