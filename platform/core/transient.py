"""Transient failures: what a retry (or the next request) can get past, as opposed to a bug.

`TRANSIENT_DATABASE_ERRORS`: the database is unreachable, restarting, or refused the transaction for a reason of the
moment (a deadlock victim, a serialization failure, SQLite's "database is locked"): Django raises OperationalError
or InterfaceError for all of them. `TRANSIENT_BROKER_ERRORS`: the broker or Redis is unreachable. The REST error
handler answers both with 503 (core.errors); node answers retry on the first (`node_answer_retry`).

Imports nothing of the rooms: core.errors loads before the apps are ready.
"""

from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TRANSIENT_DATABASE_ERRORS = (OperationalError, InterfaceError)
TRANSIENT_BROKER_ERRORS = (KombuOperationalError, RedisConnectionError, RedisTimeoutError)


def node_answer_retry() -> dict:
    """The Celery options of every task that carries a node's answer: such an answer is never lost to an outage of
    the database or of the audit trail; it is retried with jittered exponential backoff (2 s doubling up to a minute,
    for about half an hour). The handlers are status-guarded and idempotent, so running one again is harmless; the
    outbox re-sends the order behind it as a last resort. The audit trail's AuditWriteError is a TransientError."""
    from core.errors import TransientError  # late: core.errors imports this module

    return {
        "autoretry_for": (TransientError, *TRANSIENT_DATABASE_ERRORS),
        "retry_backoff": 2,
        "retry_backoff_max": 60,
        "retry_jitter": True,
        "max_retries": 30,
    }
