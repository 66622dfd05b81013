"""Console-styled refusals for what happens outside a page view: an unknown console URL, a failed CSRF check."""

from django.http import HttpResponsePermanentRedirect
from django.shortcuts import render
from django.urls import Resolver404, resolve

from console.access import error_page


class _PermanentRedirectKeepingMethod(HttpResponsePermanentRedirect):
    status_code = 308  # a form's POST is re-sent as a POST to the canonical URL (a 301 would turn it into a GET)


def not_found(request):
    """An unknown console URL: a redirect to the canonical form when the URL only gained or lost its trailing slash
    (every page answers both forms), else the 404 page in the base layout, with the navigation when signed in."""
    canonical = _other_slash_form(request.path_info)
    if canonical is not None:
        target = request.path[: len(request.path) - len(request.path_info)] + canonical
        query = request.META.get("QUERY_STRING", "")
        target += f"?{query}" if query else ""
        safe = request.method in ("GET", "HEAD")
        return (HttpResponsePermanentRedirect if safe else _PermanentRedirectKeepingMethod)(target)
    response = error_page(request, 404, "Not found", "There is no such console page.", "not_found")
    response["Cache-Control"] = "no-store"
    return response


def _other_slash_form(path_info: str) -> str | None:
    """`path_info` with its trailing slash added or removed, when that form is a console page; else None."""
    other = path_info[:-1] if path_info.endswith("/") else f"{path_info}/"
    if not other.strip("/"):
        return None
    try:
        match = resolve(other)
    except Resolver404:
        return None
    return other if match.func is not not_found else None


def csrf_failure(request, reason=""):
    """Django's CSRF refusal for HTML forms (DRF answers its own JSON): the form is not accepted, nothing changed."""
    message = (
        "This form could not be accepted (its security token was missing or stale), so nothing was changed. "
        "Reload the page and try again."
    )
    return render(
        request, "console/error.html", {"title": "Form expired", "message": message, "code": "csrf_failed"}, status=403
    )
