"""Console pages: gdpr (being written)."""

from django.shortcuts import render
from django.urls import path

from console.access import console_view, page_context


@console_view()
def index(request):
    return render(request, "console/overview.html", page_context(request, title="gdpr", section="gdpr"))


urlpatterns = [path("", index, name="gdpr")]
