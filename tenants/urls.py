"""Routes of the tenants app, mounted under /api/v1/ (controlplane.urls)."""

from django.urls import path

from tenants import apis

urlpatterns = [
    path("whoami", apis.WhoAmIApi.as_view(), name="whoami"),
    path("keys", apis.KeyListCreateApi.as_view(), name="keys"),
    path("keys/<uuid:key_id>", apis.KeyDetailApi.as_view(), name="key-detail"),
    path("keys/<uuid:key_id>/revoke", apis.KeyRevokeApi.as_view(), name="key-revoke"),
    path("keys/<uuid:key_id>/rotate", apis.KeyRotateApi.as_view(), name="key-rotate"),
    path("admin/tenants", apis.TenantListCreateApi.as_view(), name="admin-tenants"),
    path("admin/tenants/<uuid:tenant_id>", apis.TenantDetailApi.as_view(), name="admin-tenant-detail"),
    path("admin/tenants/<uuid:tenant_id>/quota", apis.TenantQuotaApi.as_view(), name="admin-tenant-quota"),
]
