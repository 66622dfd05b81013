"""Fleet routes, mounted under /api/v1/ by controlplane.urls."""

from django.urls import path

from fleet import apis

urlpatterns = [
    path("nodes/register", apis.NodeRegisterApi.as_view(), name="fleet-node-register"),
    path("nodes/heartbeat", apis.NodeHeartbeatApi.as_view(), name="fleet-node-heartbeat"),
    path("nodes/certificate", apis.NodeCertificateApi.as_view(), name="fleet-node-certificate"),
    path("admin/nodes", apis.AdminNodesApi.as_view(), name="fleet-admin-nodes"),
    path("admin/nodes/<uuid:node_id>", apis.AdminNodeDetailApi.as_view(), name="fleet-admin-node"),
    path("admin/nodes/<uuid:node_id>/cordon", apis.AdminNodeCordonApi.as_view(), name="fleet-admin-node-cordon"),
    path("admin/nodes/<uuid:node_id>/uncordon", apis.AdminNodeUncordonApi.as_view(), name="fleet-admin-node-uncordon"),
]
