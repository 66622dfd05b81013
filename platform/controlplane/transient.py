"""Transient failures: what a retry (or the next request) can get past, as opposed to a bug.

`TRANSIENT_DATABASE_ERRORS`: the database is unreachable, restarting, or refused the transaction for a reason of the
moment (a deadlock victim, a serialization failure, SQLite's "database is locked"): Django raises OperationalError
or InterfaceError for all of them. `NODE_ANSWER_RETRY`: the Celery options of every task that carries a node's
answer: such an answer is never lost to an outage of the database or the audit trail, it is retried with
jittered exponential backoff (2 s doubling up to a minute, for about half an hour). The handlers are status-guarded
and idempotent, so running one again is harmless; the outbox re-sends the order behind it as a last resort.
"""

from django.db import InterfaceError, OperationalError

from audit.services import AuditWriteError

TRANSIENT_DATABASE_ERRORS = (OperationalError, InterfaceError)

NODE_ANSWER_RETRY = {
    "autoretry_for": (AuditWriteError, *TRANSIENT_DATABASE_ERRORS),
    "retry_backoff": 2,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 30,
}
