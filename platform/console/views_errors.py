"""Console-styled refusals for what happens outside a page view: an unknown console URL, a failed CSRF check."""

from django.shortcuts import render

from console.access import error_page


def not_found(request):
    """An unknown console URL: the 404 page in the base layout, with the navigation when signed in."""
    response = error_page(request, 404, "Not found", "There is no such console page.", "not_found")
    response["Cache-Control"] = "no-store"
    return response


def csrf_failure(request, reason=""):
    """Django's CSRF refusal for HTML forms (DRF answers its own JSON): the form is not accepted, nothing changed."""
    message = (
        "This form could not be accepted (its security token was missing or stale), so nothing was changed. "
        "Reload the page and try again."
    )
    return render(
        request, "console/error.html", {"title": "Form expired", "message": message, "code": "csrf_failed"}, status=403
    )
