from django.urls import path

from caches import apis, migration_apis, recovery_apis

urlpatterns = [
    path("caches", apis.CacheListAttachApi.as_view(), name="caches"),
    path("caches/<uuid:cache_id>", apis.CacheDetailDetachApi.as_view(), name="cache"),
    path("caches/<uuid:cache_id>/recover", recovery_apis.CacheRecoverApi.as_view(), name="cache-recover"),
    path("caches/<uuid:cache_id>/tokens", apis.DataTokenIssueApi.as_view(), name="cache-tokens"),
    path("caches/<uuid:cache_id>/tokens/revoke", apis.DataTokensRevokeAllApi.as_view(), name="cache-tokens-revoke"),
    path(
        "caches/<uuid:cache_id>/tokens/<uuid:jti>/revoke", apis.DataTokenRevokeApi.as_view(), name="cache-token-revoke"
    ),
    path("admin/nodes/<uuid:node_id>/drain", migration_apis.AdminNodeDrainApi.as_view(), name="admin-node-drain"),
]
