"""One error shape everywhere: {"error": {"code": "...", "message": "...", "details": {...}}}.

Services raise ApplicationError (or a subclass) with a machine-readable code; DRF's own exceptions are mapped to the
same shape; anything unexpected is logged and answered as a 500 `internal_error` without internals.
"""

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

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


AUDIT_UNAVAILABLE = "audit_unavailable"


def audit_unavailable_body() -> dict:
    """The answer to a change refused because its audit event could not be written (it was rolled back)."""
    return error_body(AUDIT_UNAVAILABLE, "The audit trail is unavailable; nothing was changed. Retry later.")


def exception_handler(exc, context):
    from audit.services import AuditWriteError  # imported late: this module loads before the apps are ready

    if isinstance(exc, AuditWriteError):
        logger.error("refused %s: %s", context.get("view").__class__.__name__, exc)  # the cause stays in the log
        response = Response(audit_unavailable_body(), status=status.HTTP_503_SERVICE_UNAVAILABLE)
        response["Retry-After"] = "5"
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
    logger.exception("unhandled error in %s", context.get("view"))
    return Response(error_body("internal_error", "An internal error occurred."), status=500)


def json_404(request, exception=None):
    return JsonResponse(error_body("not_found", "No such resource."), status=404)


def json_500(request):
    return JsonResponse(error_body("internal_error", "An internal error occurred."), status=500)


def json_400(request, exception=None):
    return JsonResponse(error_body("bad_request", "Bad request."), status=400)


def json_403(request, exception=None):
    return JsonResponse(error_body("permission_denied", "Forbidden."), status=403)
