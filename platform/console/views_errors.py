"""Console-styled refusals for what happens outside a page view: an unknown console URL, a failed CSRF check."""

from django.shortcuts import render


def not_found(request):
    return render(
        request,
        "console/error.html",
        {"title": "Not found", "message": "There is no such console page.", "code": "not_found"},
        status=404,
    )


def csrf_failure(request, reason=""):
    """Django's CSRF refusal for HTML forms (DRF answers its own JSON): the form is not accepted, nothing changed."""
    message = (
        "This form could not be accepted (its security token was missing or stale), so nothing was changed. "
        "Reload the page and try again."
    )
    return render(
        request, "console/error.html", {"title": "Form expired", "message": message, "code": "csrf_failed"}, status=403
    )
