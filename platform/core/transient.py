"""Transient failures: what a retry (or the next request) can get past, as opposed to a bug.

`TRANSIENT_DATABASE_ERRORS`: the database is unreachable, restarting, or refused the transaction for a reason of the
moment (a deadlock victim, a serialization failure, SQLite's "database is locked"): Django raises OperationalError
or InterfaceError for all of them. `TRANSIENT_BROKER_ERRORS`: the broker or Redis is unreachable. The REST error
handler answers both with 503 (core.errors); node answers retry on the first (core.node_answers).

Imports nothing of the rooms, nor of core: core.errors loads before the apps are ready and imports this module.
"""

from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TRANSIENT_DATABASE_ERRORS = (OperationalError, InterfaceError)
TRANSIENT_BROKER_ERRORS = (KombuOperationalError, RedisConnectionError, RedisTimeoutError)
