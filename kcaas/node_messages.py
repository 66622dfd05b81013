"""The Celery messages between the control plane and node agents: task names, queues and argument lists, in one
torch-free, Django-free module both sides import, so they cannot drift apart.

control -> node, on the node's own queue `node.<node id>`:
    provision_cache(cache_id: str, spec: dict (KVCacheSpec fields), capacity: {"device","dram","ssd": bytes},
                    hash_key_b64: str (32 bytes), epoch: int)
    detach_cache(cache_id: str, epoch: int)
node -> control, on the `control` queue:
    provision_result(cache_id: str, node_id: str, ok: bool, reason: str, endpoint: str)
    detach_result(cache_id: str, node_id: str)
"""

CONTROL_QUEUE = "control"
PROVISION_TASK = "kcaas.node.provision_cache"
DETACH_TASK = "kcaas.node.detach_cache"
PROVISION_RESULT_TASK = "caches.provision_result"
DETACH_RESULT_TASK = "caches.detach_result"


def node_queue(node_id) -> str:
    return f"node.{node_id}"
