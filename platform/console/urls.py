"""The console's URLs, under /console/. Each page family's module lists its own routes."""

from django.urls import include, path, re_path

from console import views_auth, views_errors
from console.pages import audit, gdpr, nodes, overview, tenants

app_name = "console"

urlpatterns = [
    path("login", views_auth.login, name="login"),
    path("login/verify", views_auth.verify, name="verify"),
    path("login/enroll", views_auth.enroll, name="enroll"),
    path("logout", views_auth.logout, name="logout"),
    path("", include(overview.urlpatterns)),
    path("tenants/", include(tenants.urlpatterns)),
    path("nodes/", include(nodes.urlpatterns)),
    path("audit/", include(audit.urlpatterns)),
    path("gdpr/", include(gdpr.urlpatterns)),
    re_path(r"^.*$", views_errors.not_found),  # a console-styled 404 (the project's handler answers JSON)
]
