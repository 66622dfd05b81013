from django.urls import path

from audit import apis

urlpatterns = [
    path("audit/events", apis.AuditEventListApi.as_view(), name="audit-events"),
    path("audit/export", apis.AuditExportApi.as_view(), name="audit-export"),
    path("audit/digests", apis.AuditDigestListApi.as_view(), name="audit-digests"),
]
