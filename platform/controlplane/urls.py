from django.http import JsonResponse
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from controlplane import api_root
from controlplane.metrics import metrics_view
from core import errors

API_DOCS_TEMPLATE = "api_docs/redoc.html"  # Redoc without the web fonts drf-spectacular's page pulls from Google


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("", api_root.site_root, name="site-root"),
    path("api/", api_root.api_redirect),
    path("api/v1", api_root.api_redirect),
    path("api/v1/", api_root.api_root, name="api-root"),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularRedocView.as_view(url_name="schema", template_name=API_DOCS_TEMPLATE), name="docs"),
    path("api/docs/swagger/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs-swagger"),
    path("api/v1/", include("tenants.urls")),
    path("api/v1/", include("fleet.urls")),
    path("api/v1/", include("caches.urls")),
    path("api/v1/", include("routing.urls")),
    path("api/v1/", include("billing.urls")),
    path("api/v1/", include("privacy.urls")),
    path("api/v1/", include("audit.urls")),
    re_path(r"^api/(?P<path>.*)$", api_root.api_not_found),  # after every API route: unknown is a JSON 404
    path("console/", include("console.urls")),
    path("", include("caches.well_known_urls")),
    path("", include("audit.well_known_urls")),
    path("", include("fleet.well_known_urls")),
]

handler400 = errors.json_400
handler403 = errors.json_403
handler404 = errors.json_404
handler500 = errors.json_500
