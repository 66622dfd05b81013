"""Billing routes, mounted under /api/v1/ by controlplane.urls."""

from django.urls import path

from billing import apis

urlpatterns = [
    path("nodes/usage", apis.NodeUsageReportApi.as_view(), name="billing-node-usage"),
    path("usage", apis.UsageApi.as_view(), name="usage"),
    path("invoices", apis.InvoiceListApi.as_view(), name="billing-invoices"),
    path("invoices/<uuid:invoice_id>", apis.InvoiceDetailApi.as_view(), name="billing-invoice"),
    path("admin/rates", apis.AdminRatesApi.as_view(), name="billing-admin-rates"),
]
