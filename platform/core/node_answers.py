"""The control plane's end of the node's answers: one Celery task per answer message of kcaas/node_protocol/messages.py.

    @node_answer_task(ProvisionResult)
    def provision_result(answer: ProvisionResult) -> ...

registers the task under the message's name, with the retry options every node answer has (node_answer_retry:
an answer that meets a database or audit outage is retried, never lost). The task takes keyword arguments only
and calls the handler with the parsed message. A malformed answer (positional arguments, a missing, unknown or
mistyped field, another version) changes nothing: it is logged and dropped, not retried (a retry would fail the same
way); the outbox re-sends the order behind it, so a node that answers properly again settles it.

Imports no room: the rooms' tasks modules use it.
"""

import logging

from celery import shared_task

from core.errors import TransientError
from core.transient import TRANSIENT_DATABASE_ERRORS
from kcaas.node_protocol.messages import MessageError, NodeMessage

logger = logging.getLogger("kcaas.node_answers")


def node_answer_retry() -> dict:
    """The Celery options of every task that carries a node's answer: such an answer is never lost to an outage of
    the database or of the audit trail; it is retried with jittered exponential backoff (2 s doubling up to a minute,
    for about half an hour). The handlers are status-guarded and idempotent, so running one again is harmless; the
    outbox re-sends the order behind it as a last resort. The audit trail's AuditWriteError is a TransientError."""
    return {
        "autoretry_for": (TransientError, *TRANSIENT_DATABASE_ERRORS),
        "retry_backoff": 2,
        "retry_backoff_max": 60,
        "retry_jitter": True,
        "max_retries": 30,
    }


def node_answer_task(message_class: type[NodeMessage], **options):
    """Register the decorated `handler(answer)` as the shared task of `message_class` (see the module)."""

    def register(handler):
        def run(*args, **fields):
            try:
                answer = message_class.from_call(args, fields)
            except MessageError as error:
                logger.warning("dropped a malformed node answer: %s", error)
                return None
            return handler(answer)

        run.__name__, run.__qualname__, run.__doc__ = handler.__name__, handler.__qualname__, handler.__doc__
        run.__module__ = handler.__module__
        return shared_task(name=message_class.TASK, **node_answer_retry(), **options)(run)

    return register
