"""Routes of the privacy room, mounted under /api/v1/ (controlplane.urls)."""

from django.urls import path

from privacy import apis

urlpatterns = [
    path("export", apis.TenantExportApi.as_view(), name="export"),
    path("admin/tenants/<uuid:tenant_id>/export", apis.AdminTenantExportApi.as_view(), name="admin-tenant-export"),
    path("admin/tenants/<uuid:tenant_id>/erasure", apis.ErasureApi.as_view(), name="admin-tenant-erasure"),
    path(
        "admin/tenants/<uuid:tenant_id>/erasure/cancel",
        apis.ErasureCancelApi.as_view(),
        name="admin-tenant-erasure-cancel",
    ),
    path(
        "admin/tenants/<uuid:tenant_id>/erasure/receipt",
        apis.ErasureReceiptApi.as_view(),
        name="admin-tenant-erasure-receipt",
    ),
]
