"""The Celery messages between the control plane and node agents: task names, queues and argument lists, in one
torch-free, Django-free module both sides import, so they cannot drift apart.

Key material is never in clear in a message: each key is a box sealed to the receiving node's X25519 key
(kcaas/sealing.py, `kcs1.`...), bound to the task name, the node id, the cache id and the field ("hash_key",
"ssd_key"). The node refuses a key in clear.

control -> node, on the node's own queue `node.<node id>`:
    provision_cache(cache_id: str, spec: dict (KVCacheSpec fields), capacity: {"device","dram","ssd": bytes},
                    hash_key_box: str (sealed, 32 bytes), epoch: int, tenant_id: str = "", ssd_key_box: str = "")
                    (ssd_key_box: the cache's SSD data key, 32 bytes, sealed; "" = no SSD tier. The node keeps it
                    in memory only; the control plane stores it sealed under the tenant key)
    detach_cache(cache_id: str, epoch: int)
    revoke_tokens(entries: [{"jti": str, "exp": int unix seconds}])   (no answer: idempotent, and the same list
                    comes back in every register/heartbeat answer as `revoked_tokens`)
    purge_tenant(tenant_id: str, job_id: str)   (erasure: drop and zero every cache of the tenant, any epoch)
node -> control, on the `control` queue:
    provision_result(cache_id: str, node_id: str, ok: bool, reason: str, endpoint: str)
                    (reason key_not_sealed / sealed_key_invalid: a key in clear, or a box altered or sealed for
                    another message; nothing was provisioned. A box sealed to a node key the node does not hold
                    is not answered: the order comes again under the key it registered)
    detach_result(cache_id: str, node_id: str)
    purge_result(job_id: str, node_id: str, tenant_id: str, purged: [{"cache_id": str, "freed_bytes": int}])
migration (platform/caches/migration.py, gpu_node/migration_tasks.py):
    control -> target  migrate_in(migration_id, cache_id, spec, capacity, hash_key_box, epoch_to, source_node_id,
                                  tenant_id, ssd_key_box = "" (only for caches with an SSD tier); boxes sealed to
                                  the target for MIGRATE_IN_TASK)
    control -> source  migrate_out(migration_id, cache_id, epoch_from, epoch_to, target_node_id,
                                   target_migration_endpoint, target_endpoint)
    control -> source  migrate_cutover(migration_id, cache_id, epoch_from, target_endpoint, epoch_to)
    control -> source  migrate_abort(migration_id, cache_id)   (no answer: the control plane failed the migration;
                       the source lifts its write fence, unless the cache moved for good, and its sender stops)
    node -> control    migration_progress(migration_id, node_id, phase: "ready"|"copying"|"fenced", info: dict)
                       migration_result(migration_id, node_id, ok: bool, reason: str, info: dict)
"""

CONTROL_QUEUE = "control"
PROVISION_TASK = "kcaas.node.provision_cache"
DETACH_TASK = "kcaas.node.detach_cache"
REVOKE_TOKENS_TASK = "kcaas.node.revoke_tokens"
PURGE_TENANT_TASK = "kcaas.node.purge_tenant"
PURGE_RESULT_TASK = "privacy.purge_result"
PROVISION_RESULT_TASK = "caches.provision_result"
DETACH_RESULT_TASK = "caches.detach_result"
MIGRATE_IN_TASK = "kcaas.node.migrate_in"
MIGRATE_OUT_TASK = "kcaas.node.migrate_out"
MIGRATE_CUTOVER_TASK = "kcaas.node.migrate_cutover"
MIGRATE_ABORT_TASK = "kcaas.node.migrate_abort"
MIGRATION_PROGRESS_TASK = "caches.migration_progress"
MIGRATION_RESULT_TASK = "caches.migration_result"


def node_queue(node_id) -> str:
    return f"node.{node_id}"
