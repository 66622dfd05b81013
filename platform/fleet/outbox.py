"""Orders to node agents through a transactional outbox: they survive a broker outage.

    order_enqueue(...)        in the caller's transaction: one NodeOrder row (superseding the open order with the
                              same node and key); after commit it is published at once (the fast path)
    orders_dispatch()         beat, every KCAAS_ORDER_DISPATCH_SECONDS: publishes every due open order — the ones
                              whose first publish failed (the broker was down) and, for orders that expect an
                              answer, the ones not acknowledged since their last send (backoff up to
                              KCAAS_ORDER_RESEND_MAX_SECONDS)
    orders_acknowledge(...)   the node's answer arrived: the order is done (called in the answer's transaction)
    orders_close(...)         the owner moved on (a cache that failed, a migration that ended): no more sends

Every order is a typed message of kcaas/node_protocol/messages.py, sent as keyword arguments (`message.to_dict()`).
Keys never travel in clear: a builder seals each key its message carries to the receiving node's registered X25519
key (`seal_for_node`, kcaas/node_protocol/sealing.py), bound to the task, node, cache and field, so the broker (Redis,
or the embedded file broker's files) never holds a usable key. A node with no key on record is sent nothing: the builder
raises NodeSealingKeyMissing, the order stays due (last_error `node_sealing_key_missing`) and goes once the node
registers a key.

A published message whose answer is lost (the node's broker connection died, the control worker failed on a
database error) is therefore sent again until the answer arrives; the node's handlers are idempotent (cache id and
epoch, migration id). Orders to a lost node are dropped: a node that registers again is reconciled from the
caches' own states (caches_reconcile_node, migrations_redrive_node), not from stale orders.

Lock order: order rows are the last rows a transaction locks (after tenant, cache, migration and node rows), and the
dispatcher locks nothing else while it holds them (skip-locked, so two dispatchers never send one order together).
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from core.celery import app as celery_app
from fleet.errors import NodeSealingKeyMissing
from fleet.models import OPEN_ORDER_STATES, Node, NodeOrder, NodeState, OrderState
from kcaas.node_protocol.messages import NodeMessage, message_class, node_queue
from kcaas.node_protocol.sealing import seal

logger = logging.getLogger("kcaas.fleet.outbox")
MAX_ERROR_LENGTH = 300
NODE_SEALING_KEY_MISSING = "node_sealing_key_missing"  # why an order carrying keys was not sent (seal_for_node)
# Connection attempts before a publish gives up: the request path's fast path never waits on a down broker (the
# dispatcher sends the order later), the dispatcher tries twice per run.
FAST_PATH_CONNECT_RETRIES = 0
DISPATCH_CONNECT_RETRIES = 1


def order_enqueue(
    *,
    node_id,
    key: str,
    message: NodeMessage | None = None,
    task: str = "",
    builder: str = "",
    builder_args: list | None = None,
    expects_answer: bool = True,
) -> NodeOrder:
    """Write the order in the current transaction (it must be one: the order commits with the change it carries
    out) and publish it right after commit. Either `message` (a kcaas.node_protocol.messages message without secrets:
    stored as its to_dict()) or, for a message that carries keys, `task`, `builder` (dotted path) and `builder_args`
    (ids only): the builder makes the message at send time (see NodeOrder)."""
    assert transaction.get_connection().in_atomic_block, "an order is written in the transaction of its change"
    assert (message is None) != (not builder), "an order is a message or a builder's, not both"
    if message is not None:
        task, args = message.TASK, message.to_dict()
    else:
        message_class(task)  # a task that is no control -> node message is a bug here, not at send time
        args = list(builder_args or [])
    now = timezone.now()
    NodeOrder.objects.filter(node_id=node_id, key=key, state__in=OPEN_ORDER_STATES).update(
        state=OrderState.DONE, closed_at=now, last_error="superseded"
    )
    order = NodeOrder.objects.create(
        node_id=node_id,
        task=task,
        key=key,
        args=args,
        builder=builder,
        expects_answer=expects_answer,
        next_attempt_at=now,
    )
    transaction.on_commit(lambda: _publish_after_commit(order.pk), robust=True)
    return order


def orders_acknowledge(*, node_id, key: str, tasks: tuple[str, ...]) -> int:
    """The node answered the open order `key` (one of `tasks`): it is done. Returns how many orders closed."""
    return _close(node_id=node_id, key=key, tasks=tasks, reason="")


def orders_close(*, node_id, key: str, reason: str) -> int:
    """No more sends of the open order `key` on that node (its owner moved on). Returns how many closed."""
    return _close(node_id=node_id, key=key, tasks=None, reason=reason)


def _close(*, node_id, key: str, tasks, reason: str) -> int:
    if node_id is None:
        return 0
    orders = NodeOrder.objects.filter(node_id=node_id, key=key, state__in=OPEN_ORDER_STATES)
    if tasks is not None:
        orders = orders.filter(task__in=tasks)
    return orders.update(state=OrderState.DONE, closed_at=timezone.now(), last_error=reason[:MAX_ERROR_LENGTH])


def _publish_after_commit(order_id: int) -> None:
    """The fast path: publish a just-committed order once, without waiting on a down broker. Whatever fails here
    (the broker, the database) leaves the order due for the dispatcher."""
    try:
        with transaction.atomic():
            order = (
                NodeOrder.objects.select_for_update(skip_locked=True, no_key=True)
                .filter(pk=order_id, state=OrderState.PENDING, attempts=0)
                .first()
            )
            if order is not None:
                with _broker(FAST_PATH_CONNECT_RETRIES) as connection:
                    _send(order, timezone.now(), connection)
    except DatabaseError as error:
        logger.warning("order %s: left for the dispatcher: %s", order_id, error)


@transaction.atomic
def orders_dispatch(*, now: datetime | None = None, limit: int = 500) -> dict[str, int]:
    """Publish every due open order (oldest due first, at most `limit`); stops at the first broker failure (the
    rest stay due). Returns counts by outcome."""
    now = now or timezone.now()
    due = list(
        NodeOrder.objects.select_for_update(skip_locked=True, no_key=True)
        .filter(state__in=OPEN_ORDER_STATES, next_attempt_at__lte=now)
        .order_by("next_attempt_at", "id")[:limit]
    )
    counts = {"sent": 0, "failed": 0, "dropped": 0, "moot": 0, "error": 0}
    lost = set(Node.objects.filter(pk__in={o.node_id for o in due}, state=NodeState.LOST).values_list("id", flat=True))
    max_age = timedelta(seconds=settings.KCAAS_ORDER_MAX_AGE_SECONDS)
    with _broker(DISPATCH_CONNECT_RETRIES) as connection:
        for order in due:
            if order.node_id in lost or now - order.created_at > max_age:
                _finish(order, OrderState.DROPPED, now, "node_lost" if order.node_id in lost else "expired")
                counts["dropped"] += 1
                continue
            outcome = _send(order, now, connection)
            counts[outcome] += 1
            if outcome == "failed":
                break  # the broker is down: the other due orders wait for the next run
    return counts


def seal_for_node(*, node_id, task: str, cache_id, field: str, plaintext: bytes) -> str:
    """`plaintext` (a key) sealed to node `node_id`'s registered sealing key for one message: `task` to that node
    about `cache_id`, in its `field`. NodeSealingKeyMissing when the node registered no key: nothing is sealed or
    sent, never a key in clear. Builders call it at send time, so a re-sent order is sealed to the node's current
    key (an agent that restarted with a new key gets the order again under it)."""
    public_key = Node.objects.filter(pk=node_id).values_list("sealing_public_key", flat=True).first()
    if not public_key:
        raise NodeSealingKeyMissing(
            f"{NODE_SEALING_KEY_MISSING}: node {node_id} registered no sealing key (an agent "
            f"older than key sealing: upgrade it); no key is sent in clear"
        )
    return seal(plaintext, public_key_b64=public_key, task=task, node_id=node_id, cache_id=cache_id, field=field)


def _broker(connect_retries: int):
    """A connection of its own to the broker that gives up after `connect_retries` attempts (kombu's default keeps
    reconnecting for seconds, and the pool's connections are shared with the rest of the process)."""
    return celery_app.connection_for_write(transport_options={"max_retries": connect_retries})


def _order_message(order: NodeOrder) -> NodeMessage | None:
    """The message an order sends: its builder's (None: moot), else the stored to_dict(), else (a row written
    before messages were typed) its positional argument list read in the message's field order."""
    if order.builder:
        message = import_string(order.builder)(*order.args)
        assert message is None or message.TASK == order.task, "a builder makes its order's message"
        return message
    kind = message_class(order.task)
    if isinstance(order.args, dict):
        return kind.from_dict(order.args)
    first_version = min({kind.VERSION, *kind.EARLIER})  # a positional row predates every later field
    return kind.from_dict({"v": first_version, **dict(zip(kind.field_names(), order.args))})


def _send(order: NodeOrder, now: datetime, connection) -> str:
    """Publish one locked order; "sent", "moot" (its builder found nothing left to do), "failed" (the broker) or
    "error" (its message could not be made: the order is tried again after a backoff, and the other due orders
    still go)."""
    try:
        with transaction.atomic():  # a savepoint: a builder's database error leaves the run's transaction usable
            message = _order_message(order)
    except Exception as error:
        if isinstance(error, NodeSealingKeyMissing):
            logger.warning("order %s (%s to node %s) not sent: %s", order.pk, order.task, order.node_id, error)
        else:
            logger.exception("order %s (%s to node %s): its message failed", order.pk, order.task, order.node_id)
        order.attempts += 1
        order.last_error = f"builder: {type(error).__name__}: {error}"[:MAX_ERROR_LENGTH]
        backoff = _backoff(order.attempts, settings.KCAAS_ORDER_RESEND_SECONDS)
        order.next_attempt_at = now + timedelta(seconds=backoff)
        order.save(update_fields=["attempts", "last_error", "next_attempt_at"])
        return "error"
    if message is None:
        _finish(order, OrderState.DONE, now, "moot")
        return "moot"
    try:
        celery_app.send_task(
            message.TASK, kwargs=message.to_dict(), queue=node_queue(order.node_id), connection=connection, retry=False
        )
    except Exception as error:  # noqa: BLE001 - kombu/redis raise many types for a broker that is not there
        order.attempts += 1
        order.last_error = f"{type(error).__name__}: {error}"[:MAX_ERROR_LENGTH]
        order.next_attempt_at = now  # due again at the dispatcher's next run (it stops at the first failure)
        order.save(update_fields=["attempts", "last_error", "next_attempt_at"])
        logger.warning("order %s (%s to node %s) not sent: %s", order.pk, order.task, order.node_id, order.last_error)
        return "failed"
    order.attempts += 1
    order.last_sent_at, order.last_error = now, ""
    if not order.expects_answer:
        _finish(order, OrderState.DONE, now, "")
        return "sent"
    order.state = OrderState.SENT
    order.next_attempt_at = now + timedelta(seconds=_backoff(order.attempts, settings.KCAAS_ORDER_RESEND_SECONDS))
    order.save(update_fields=["attempts", "last_sent_at", "last_error", "state", "next_attempt_at"])
    return "sent"


def _backoff(attempts: int, base: float) -> float:
    """base, 2*base, 4*base, ... capped at KCAAS_ORDER_RESEND_MAX_SECONDS."""
    return min(settings.KCAAS_ORDER_RESEND_MAX_SECONDS, base * 2 ** max(0, attempts - 1))


def _finish(order: NodeOrder, state: str, now: datetime, reason: str) -> None:
    order.state, order.closed_at, order.last_error = state, now, reason[:MAX_ERROR_LENGTH]
    order.save(update_fields=["state", "closed_at", "last_error", "attempts", "last_sent_at"])


def open_orders(*, node_id: uuid.UUID | None = None) -> list[NodeOrder]:
    """The open orders (of one node), oldest first: for operators and tests."""
    orders = NodeOrder.objects.filter(state__in=OPEN_ORDER_STATES)
    if node_id is not None:
        orders = orders.filter(node_id=node_id)
    return list(orders.order_by("id"))
