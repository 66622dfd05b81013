"""Who may see a console page, and how refusals look.

`console_view(capability)` wraps every page: a signed-in console session (password, then TOTP, then a role) or a
redirect to the sign-in page (an `HX-Redirect` for htmx requests); the capability or a 403 page; the allowed
methods or a 405 page. Errors raised by the services the page calls become pages with the service's own message
and code, never a 500: ApplicationError (its status), AuditWriteError (503: nothing was changed, since the change and
its audit event share one transaction), Http404/NotFoundError (404). Every console answer is `no-store`.
"""

from __future__ import annotations

import functools
from urllib.parse import urlencode

from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse

from audit.services import AuditWriteError
from console import roles
from core.errors import ApplicationError

SESSION_FLAG = "kcaas_console"  # set by the console sign-in; the REST API refuses sessions carrying it


def signed_in(request) -> bool:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or not request.session.get(SESSION_FLAG):
        return False
    return bool(getattr(user, "is_verified", lambda: False)()) and roles.has_console_role(user)


def login_redirect(request, *, reason: str = "") -> HttpResponse:
    query = {"next": request.get_full_path()} if request.method == "GET" and not request.htmx else {}
    if reason:
        query["reason"] = reason
    url = reverse("console:login") + (f"?{urlencode(query)}" if query else "")
    if request.htmx:  # a partial swap must not paint the sign-in page into a table cell
        response = HttpResponse(status=204)
        response["HX-Redirect"] = url
        return response
    return HttpResponseRedirect(url)


def error_page(request, status: int, title: str, message: str, code: str = "") -> HttpResponse:
    """The refusal inside the base layout; a signed-in user keeps the navigation (their roles are in the context)."""
    template = "console/error_fragment.html" if request.htmx else "console/error.html"
    context = {"title": title, "message": message, "code": code}
    if signed_in(request):
        context = page_context(request, **context)
    response = render(request, template, context, status=status)
    if request.htmx:  # show the refusal where the request came from, not swapped into a polled region
        response["HX-Retarget"] = "#console-alerts"
        response["HX-Reswap"] = "innerHTML"
    return response


def console_view(capability: str = "view", *, methods: tuple[str, ...] = ("GET",)):
    assert capability in roles.CAPABILITIES
    allowed = frozenset(m.upper() for m in methods) | ({"HEAD"} if "GET" in methods else set())

    def decorate(view):
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            if not signed_in(request):
                return login_redirect(request)
            if request.method not in allowed:
                response = error_page(
                    request, 405, "Method not allowed", f"{request.method} is not accepted here.", "method_not_allowed"
                )
                response["Allow"] = ", ".join(sorted(allowed))
                return response
            if not roles.can(request.user, capability):
                return error_page(
                    request,
                    403,
                    "Not allowed",
                    "Your console role does not allow this. Ask an administrator for the role.",
                    "permission_denied",
                )
            try:
                response = view(request, *args, **kwargs)
            except AuditWriteError:
                response = error_page(
                    request,
                    503,
                    "Audit trail unavailable",
                    "The audit trail could not record this action, so nothing was changed. Try again shortly.",
                    "audit_unavailable",
                )
            except Http404:
                response = error_page(request, 404, "Not found", "There is nothing here.", "not_found")
            except ApplicationError as error:
                response = error_page(request, error.status_code, "Refused", error.message, error.code)
            response["Cache-Control"] = "no-store"
            return response

        wrapper.console_capability = capability
        return wrapper

    return decorate


def page_context(request, **extra) -> dict:
    """What every page's template reads beside its own data: the user's roles and capabilities."""
    return {"console_roles": sorted(roles.user_roles(request.user)), "can": roles.capabilities(request.user), **extra}
