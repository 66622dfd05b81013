"""Console pages: the overview (being written)."""

from django.shortcuts import render
from django.urls import path

from console.access import console_view, page_context


@console_view()
def overview(request):
    return render(request, "console/overview.html", page_context(request, title="Overview"))


urlpatterns = [path("", overview, name="overview")]
