"""The Celery messages between the control plane and node agents: task names, queues and one typed message per task,
in one torch-free, Django-free (stdlib only) module both sides import, so they cannot drift apart.

Every message is a frozen dataclass below. It travels as Celery KEYWORD arguments, never positional ones:

    app.send_task(msg.TASK, kwargs=msg.to_dict(), queue=...)        # the sender
    msg = ProvisionCache.from_call(args, kwargs)                     # the receiving task (`def task(*args, **kwargs)`)

`to_dict()` is the message's fields plus its version `"v"` (the class's VERSION: 1, or 2 for the messages that grew
a field); `from_dict()` / `from_call()` refuse, with a MessageError naming the task and the field, anything that is
not exactly this message: positional arguments, a missing or unknown version, a missing or unknown field, a field of
the wrong type or shape (a bool is not an integer). Building a message checks the same, so neither side can send
what the other would refuse. The receiving side decides what a refusal means: a node answers a malformed order that
expects an answer as failed with the reason (`invalid_message: ...`, see gpu_node/agent/tasks.py); the control plane
logs a malformed answer and changes nothing. A field added to a message bumps that message's VERSION and names, in
its EARLIER map, each earlier version it still reads and the value each field that version lacked means there
(ProvisionCache / MigrateIn v1 had no `network_write_through`: False), so an order written by an older sender (an
outbox row, a redelivery) still parses; such an older message may not carry the newer field. A change that is not
backwards compatible (a field renamed or retyped) bumps VERSION with no EARLIER entry: a receiver refuses a version
it does not speak, so control plane and nodes move to a new version together.

Key material is never in clear in a message: each key is a box sealed to the receiving node's X25519 key
(kcaas/node_protocol/sealing.py, `kcs1.`...), bound to the task name, the node id, the cache id and the field
("hash_key", "ssd_key"); here a box is only a string (the node opens it, and refuses a key in clear: key_not_sealed).

control -> node, on the node's own queue `node.<node id>` (answered on the `control` queue):
    ProvisionCache   provision_cache(cache_id, spec: KVCacheSpec fields, capacity: {"device","dram","ssd",
                     "network": bytes} (network: the cache's share of the fleet's network store, not a node's bytes),
                     hash_key_box (sealed, 32 bytes), epoch, tenant_id, ssd_key_box ("" = neither an SSD nor a network
                     tier; else the cache's data key, sealed: the node keeps it in memory only; it seals SSD records
                     and names and seals network objects), network_write_through (v2; v1: False: every full block a
                     put publishes is in the network store before the put is acknowledged))
                     -> ProvisionResult(cache_id, node_id, ok, reason, endpoint)  (reason key_not_sealed /
                     sealed_key_invalid: a key in clear, or a box altered or sealed for another message; nothing was
                     provisioned. A box sealed to a node key the node does not hold is not answered: the order comes
                     again under the key it registered; invalid_message: ...: the order itself was malformed)
    DetachCache      detach_cache(cache_id, epoch, forget_network (v2; v1: False: the cache's network objects stay
                     for its next node; True when the tenant detaches it for good)) -> DetachResult(cache_id, node_id)
    RevokeTokens     revoke_tokens(entries: [{"jti": str, "exp": int unix seconds}])  (no answer: idempotent, and the
                     same list comes back in every register/heartbeat answer as `revoked_tokens`)
    PurgeTenant      purge_tenant(tenant_id, job_id)  (erasure: drop and zero every cache of the tenant, any epoch)
                     -> PurgeResult(job_id, node_id, tenant_id, purged: [{"cache_id": str, "freed_bytes": int}])
migration (platform/caches/migration.py, gpu_node/migration/tasks.py):
    MigrateIn        control -> target  migrate_in(migration_id, cache_id, spec, capacity, hash_key_box, epoch_to,
                     source_node_id, tenant_id, ssd_key_box ("" unless the cache has an SSD or network tier),
                     network_write_through (v2; v1: False); boxes sealed to the target for MIGRATE_IN_TASK)
    MigrateOut       control -> source  migrate_out(migration_id, cache_id, epoch_from, epoch_to, target_node_id,
                     target_migration_endpoint, target_endpoint)
    MigrateCutover   control -> source  migrate_cutover(migration_id, cache_id, epoch_from, target_endpoint, epoch_to)
                     (no answer)
    MigrateAbort     control -> source  migrate_abort(migration_id, cache_id)   (no answer: the control plane failed
                     the migration; the source lifts its write fence, unless the cache moved for good, and its sender
                     stops)
    MigrationProgress  node -> control  migration_progress(migration_id, node_id, phase: "ready"|"copying"|"fenced",
                     info: {str: JSON scalar})
    MigrationResult  node -> control    migration_result(migration_id, node_id, ok, reason, info: {str: JSON scalar})
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

VERSION = 1
VERSION_FIELD = "v"
INVALID_MESSAGE = "invalid_message"  # the reason a node answers a malformed order with (then ": " and the detail)

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

TIERS = ("device", "dram", "ssd", "network")  # network: the fleet's shared store (docs/ARCHITECTURE.md)
NODE_TIERS = ("device", "dram", "ssd")  # the tiers a node holds bytes of (network is the fleet's, not a node's)
PHASES = ("ready", "copying", "fenced")
MAX_ID_CHARS = 200


def node_queue(node_id) -> str:
    return f"node.{node_id}"


class MessageError(ValueError):
    """A message that is not exactly its task's: `task`, the `field` at fault (None: the message as a whole) and the
    `problem`. The text names them, never a field's value."""

    def __init__(self, task: str, field: str | None, problem: str):
        self.task, self.field, self.problem = task, field, problem
        super().__init__(f"{task}: field {field!r}: {problem}" if field else f"{task}: {problem}")


# ---- field kinds: the annotation names the check (None: fine, else the problem) --------------------------------------
Id = str  # a non-empty string id (cache, node, migration, job, tenant)
Text = str  # any string (a reason, an endpoint, a sealed box or "")
Epoch = int  # a placement epoch: an integer >= 1
Flag = bool
Spec = dict  # KVCacheSpec.to_dict() fields (the node checks the layout itself and answers invalid_spec)
Capacity = dict  # {tier: bytes}, tiers among TIERS, non-negative integers
Phase = str  # one of PHASES
Info = dict  # {str: str | int | float | bool | None}
RevokedTokens = list  # [{"jti": str, "exp": int}]
PurgedCaches = list  # [{"cache_id": str, "freed_bytes": int >= 0}]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"must be a string, not {_type_name(value)}"


def _check_id(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"must be a string id, not {_type_name(value)}"
    if not value or len(value) > MAX_ID_CHARS:
        return f"must be a non-empty id of at most {MAX_ID_CHARS} characters"
    return None


def _check_epoch(value: Any) -> str | None:
    if not _is_int(value):
        return f"must be an integer, not {_type_name(value)}"
    return None if value >= 1 else "must be at least 1"


def _check_flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, not {_type_name(value)}"


def _check_object(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"must be an object, not {_type_name(value)}"
    if not all(isinstance(key, str) for key in value):
        return "must have string keys"
    return None


def _check_capacity(value: Any) -> str | None:
    problem = _check_object(value)
    if problem:
        return problem
    for tier, nbytes in value.items():
        if tier not in TIERS:
            return f"unknown tier {tier!r} (tiers: {', '.join(TIERS)})"
        if not _is_int(nbytes) or nbytes < 0:
            return f"{tier!r} must be a non-negative integer number of bytes"
    return None


def _check_phase(value: Any) -> str | None:
    return None if isinstance(value, str) and value in PHASES else f"must be one of {', '.join(PHASES)}"


def _check_info(value: Any) -> str | None:
    problem = _check_object(value)
    if problem:
        return problem
    for key, item in value.items():
        if item is not None and not isinstance(item, (str, int, float, bool)):
            return f"{key!r} must be a string, number, boolean or null, not {_type_name(item)}"
    return None


def _records(shape: dict[str, Callable[[Any], str | None]]) -> Callable[[Any], str | None]:
    """A check of a list of objects with exactly the keys of `shape`, each passing its check."""

    def check(value: Any) -> str | None:
        if not isinstance(value, list):
            return f"must be a list, not {_type_name(value)}"
        for index, item in enumerate(value):
            if not isinstance(item, dict) or set(item) != set(shape):
                return f"item {index} must be an object with exactly {', '.join(sorted(shape))}"
            for key, item_check in shape.items():
                problem = item_check(item[key])
                if problem:
                    return f"item {index}: {key!r} {problem}"
        return None

    return check


def _check_non_negative(value: Any) -> str | None:
    if not _is_int(value):
        return f"must be an integer, not {_type_name(value)}"
    return None if value >= 0 else "must be at least 0"


def _check_integer(value: Any) -> str | None:
    return None if _is_int(value) else f"must be an integer, not {_type_name(value)}"


_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "Id": _check_id,
    "Text": _check_text,
    "Epoch": _check_epoch,
    "Flag": _check_flag,
    "Spec": _check_object,
    "Capacity": _check_capacity,
    "Phase": _check_phase,
    "Info": _check_info,
    "RevokedTokens": _records({"jti": _check_id, "exp": _check_integer}),
    "PurgedCaches": _records({"cache_id": _check_id, "freed_bytes": _check_non_negative}),
}


@dataclass(frozen=True)
class NodeMessage:
    """One Celery message between the control plane and a node: its fields are the task's keyword arguments."""

    TASK: ClassVar[str] = ""
    VERSION: ClassVar[int] = VERSION
    # Earlier versions still read: {version: {field that version lacks: the value it means there}}.
    EARLIER: ClassVar[dict[int, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            problem = _CHECKS[str(field.type)](getattr(self, field.name))  # annotations are strings here
            if problem:
                raise MessageError(self.TASK, field.name, problem)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The Celery keyword arguments: the version and every field (copies: the message stays as it was)."""
        return {
            VERSION_FIELD: self.VERSION,
            **{name: copy.deepcopy(getattr(self, name)) for name in self.field_names()},
        }

    @classmethod
    def from_dict(cls, data: Any):
        """The message `data` (what to_dict made) holds; MessageError unless it is exactly one of this version."""
        if not isinstance(data, dict):
            raise MessageError(cls.TASK, None, f"must be an object of named fields, not {_type_name(data)}")
        if VERSION_FIELD not in data:
            raise MessageError(cls.TASK, VERSION_FIELD, "missing (the message version)")
        data = cls._upgraded(data)
        names = cls.field_names()
        unknown = sorted(str(key) for key in data if key not in names and key != VERSION_FIELD)
        if unknown:
            also = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            raise MessageError(cls.TASK, unknown[0], "unknown field" + also)
        missing = [name for name in names if name not in data]
        if missing:
            also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
            raise MessageError(cls.TASK, missing[0], "missing" + also)
        return cls(**{name: data[name] for name in names})

    @classmethod
    def _upgraded(cls, data: dict) -> dict:
        """`data` as a message of this version: an earlier version in EARLIER gets the fields it lacks (refused if
        it carries one of them); any other version is refused."""
        version = data[VERSION_FIELD]
        if _is_int(version) and version == cls.VERSION:
            return data
        if not _is_int(version) or version not in cls.EARLIER:
            shown = version if _is_int(version) else _type_name(version)
            spoken = ", ".join(str(v) for v in sorted({*cls.EARLIER, cls.VERSION}))
            raise MessageError(
                cls.TASK, VERSION_FIELD, f"version {shown} is not understood (this side speaks {spoken})"
            )
        lacked = cls.EARLIER[version]
        carried = sorted(name for name in lacked if name in data)
        if carried:
            raise MessageError(cls.TASK, carried[0], f"unknown field in version {version}")
        return {**data, **copy.deepcopy(lacked), VERSION_FIELD: cls.VERSION}

    @classmethod
    def from_call(cls, args: tuple | list, kwargs: dict):
        """The message a Celery task was called with: keyword arguments only (a positional list is refused)."""
        if args:
            raise MessageError(
                cls.TASK, None, f"{len(args)} positional argument(s): messages travel as keyword arguments only"
            )
        return cls.from_dict(kwargs)


# ---- control -> node -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProvisionCache(NodeMessage):
    TASK: ClassVar[str] = PROVISION_TASK
    cache_id: Id
    spec: Spec
    capacity: Capacity
    hash_key_box: Text  # sealed to the node (kcaas/node_protocol/sealing.py), field "hash_key"
    epoch: Epoch
    tenant_id: Id
    ssd_key_box: Text  # sealed, field "ssd_key": the cache's data key; "" = neither an SSD nor a network tier
    network_write_through: Flag  # v2: a put is acknowledged once its full blocks are in the network store

    VERSION: ClassVar[int] = 2
    EARLIER: ClassVar[dict[int, dict[str, Any]]] = {1: {"network_write_through": False}}


@dataclass(frozen=True)
class DetachCache(NodeMessage):
    TASK: ClassVar[str] = DETACH_TASK
    cache_id: Id
    epoch: Epoch
    forget_network: Flag  # v2: the cache is deleted: its network objects go too (else they stay for its next node)

    VERSION: ClassVar[int] = 2
    EARLIER: ClassVar[dict[int, dict[str, Any]]] = {1: {"forget_network": False}}


@dataclass(frozen=True)
class RevokeTokens(NodeMessage):
    TASK: ClassVar[str] = REVOKE_TOKENS_TASK
    entries: RevokedTokens


@dataclass(frozen=True)
class PurgeTenant(NodeMessage):
    TASK: ClassVar[str] = PURGE_TENANT_TASK
    tenant_id: Id
    job_id: Id


@dataclass(frozen=True)
class MigrateIn(NodeMessage):
    TASK: ClassVar[str] = MIGRATE_IN_TASK
    migration_id: Id
    cache_id: Id
    spec: Spec
    capacity: Capacity
    hash_key_box: Text  # sealed to the target for MIGRATE_IN_TASK
    epoch_to: Epoch
    source_node_id: Id
    tenant_id: Id
    ssd_key_box: Text  # "" unless the cache has an SSD or network tier
    network_write_through: Flag  # v2, as ProvisionCache's

    VERSION: ClassVar[int] = 2
    EARLIER: ClassVar[dict[int, dict[str, Any]]] = {1: {"network_write_through": False}}


@dataclass(frozen=True)
class MigrateOut(NodeMessage):
    TASK: ClassVar[str] = MIGRATE_OUT_TASK
    migration_id: Id
    cache_id: Id
    epoch_from: Epoch
    epoch_to: Epoch
    target_node_id: Id
    target_migration_endpoint: Text  # host:port of the target's migration listener
    target_endpoint: Text  # the target's data-plane endpoint (what MOVED names)


@dataclass(frozen=True)
class MigrateCutover(NodeMessage):
    TASK: ClassVar[str] = MIGRATE_CUTOVER_TASK
    migration_id: Id
    cache_id: Id
    epoch_from: Epoch
    target_endpoint: Text
    epoch_to: Epoch


@dataclass(frozen=True)
class MigrateAbort(NodeMessage):
    TASK: ClassVar[str] = MIGRATE_ABORT_TASK
    migration_id: Id
    cache_id: Id


# ---- node -> control -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProvisionResult(NodeMessage):
    TASK: ClassVar[str] = PROVISION_RESULT_TASK
    cache_id: Id
    node_id: Id
    ok: Flag
    reason: Text  # "" when ok
    endpoint: Text  # the node's data-plane endpoint when ok, else ""


@dataclass(frozen=True)
class DetachResult(NodeMessage):
    TASK: ClassVar[str] = DETACH_RESULT_TASK
    cache_id: Id
    node_id: Id


@dataclass(frozen=True)
class PurgeResult(NodeMessage):
    TASK: ClassVar[str] = PURGE_RESULT_TASK
    job_id: Id
    node_id: Id
    tenant_id: Id
    purged: PurgedCaches


@dataclass(frozen=True)
class MigrationProgress(NodeMessage):
    TASK: ClassVar[str] = MIGRATION_PROGRESS_TASK
    migration_id: Id
    node_id: Id
    phase: Phase
    info: Info  # "ready": {"migration_endpoint"}; "copying": {"blocks", "bytes_sent", "blocks_sent"}; "fenced": {}


@dataclass(frozen=True)
class MigrationResult(NodeMessage):
    TASK: ClassVar[str] = MIGRATION_RESULT_TASK
    migration_id: Id
    node_id: Id
    ok: Flag
    reason: Text
    info: Info  # {"blocks", "blocks_sent", "bytes_sent", "rounds", "attempts"} (what is known)


ORDERS: tuple[type[NodeMessage], ...] = (
    ProvisionCache,
    DetachCache,
    RevokeTokens,
    PurgeTenant,
    MigrateIn,
    MigrateOut,
    MigrateCutover,
    MigrateAbort,
)
ANSWERS: tuple[type[NodeMessage], ...] = (
    ProvisionResult,
    DetachResult,
    PurgeResult,
    MigrationProgress,
    MigrationResult,
)
MESSAGES: dict[str, type[NodeMessage]] = {message.TASK: message for message in (*ORDERS, *ANSWERS)}


def message_class(task: str) -> type[NodeMessage]:
    """The message class of a task name; MessageError for a task that is no message of this module."""
    try:
        return MESSAGES[task]
    except KeyError:
        raise MessageError(str(task), None, "not a control/node task") from None
