"""Key usage counters: recorded in Redis on the request path, moved to PostgreSQL in batches by a Celery task.

Request path (``record_key_use``): one pipelined round trip, no database write:
    HINCRBY {kcaas:keyusage}:count <key id> 1        -- uses since the last claimed batch
    ZADD    {kcaas:keyusage}:last GT <unix ts> <key id>  -- latest use (GT: never moves backwards)

Flush (``claim_batch`` -> services.api_key_usage_apply -> ``release_batch``):
1. A Lua script renames both live structures to the batch keys and stores a fresh batch id, atomically, so uses that
   arrive meanwhile start a new live set. If a batch is already pending (a previous flush died before releasing it)
   the script returns that batch again instead of claiming a new one.
2. The batch is applied in one database transaction that also inserts KeyUsageFlush(batch_id): a batch applied
   twice (a crash between commit and release, two workers) hits the primary key and changes nothing.
3. Release deletes the batch keys if the batch id still matches.
All keys share the hash tag ``{kcaas:keyusage}`` so the scripts stay valid on a Redis cluster.

Without REDIS_URL (the embedded default, SQLite, one process) the use is written to the database directly.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from tenants.redis_client import get_redis

logger = logging.getLogger("kcaas.tenants.usage")

LIVE_COUNT = "{kcaas:keyusage}:count"
LIVE_LAST = "{kcaas:keyusage}:last"
BATCH_COUNT = "{kcaas:keyusage}:batch:count"
BATCH_LAST = "{kcaas:keyusage}:batch:last"
BATCH_ID = "{kcaas:keyusage}:batch:id"

_CLAIM_LUA = """
local pending = redis.call('GET', KEYS[5])
if pending then return pending end
local found = 0
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('RENAME', KEYS[1], KEYS[3]); found = 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[4]); found = 1 end
if found == 0 then return false end
redis.call('SET', KEYS[5], ARGV[1])
return ARGV[1]
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class UsageBatch:
    """A claimed batch: uses per key id and the latest use time per key id."""

    batch_id: uuid.UUID
    counts: dict[uuid.UUID, int]
    last_used: dict[uuid.UUID, datetime]


def record_key_use(api_key_id: uuid.UUID) -> None:
    """Count one authenticated use of a key. Redis errors are logged, never fail the request."""
    client = get_redis()
    if client is None:
        _record_in_database(api_key_id)
        return
    member = str(api_key_id)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.hincrby(LIVE_COUNT, member, 1)
        pipe.zadd(LIVE_LAST, {member: time.time()}, gt=True)
        pipe.execute()
    except redis.RedisError:
        logger.warning("could not record key usage for %s", member, exc_info=True)


def _record_in_database(api_key_id: uuid.UUID) -> None:
    from django.db.models import F
    from django.utils import timezone

    from tenants.models import ApiKey

    ApiKey.objects.filter(pk=api_key_id).update(use_count=F("use_count") + 1, last_used_at=timezone.now())


def claim_batch(client: redis.Redis) -> UsageBatch | None:
    """Move the live counters into the batch slot (or return the pending batch); None when nothing was used."""
    raw_id = client.eval(_CLAIM_LUA, 5, LIVE_COUNT, LIVE_LAST, BATCH_COUNT, BATCH_LAST, BATCH_ID, str(uuid.uuid4()))
    if raw_id is None:
        return None
    batch_id = uuid.UUID(raw_id.decode() if isinstance(raw_id, bytes) else raw_id)
    counts = {}
    for member, value in client.hgetall(BATCH_COUNT).items():
        key_id = _parse_member(member)
        if key_id is not None and int(value) > 0:
            counts[key_id] = int(value)
    last_used = {}
    for member, score in client.zrange(BATCH_LAST, 0, -1, withscores=True):
        key_id = _parse_member(member)
        if key_id is not None:
            last_used[key_id] = datetime.fromtimestamp(score, tz=UTC)
    return UsageBatch(batch_id=batch_id, counts=counts, last_used=last_used)


def release_batch(client: redis.Redis, batch_id: uuid.UUID) -> bool:
    return bool(client.eval(_RELEASE_LUA, 3, BATCH_COUNT, BATCH_LAST, BATCH_ID, str(batch_id)))


def _parse_member(member) -> uuid.UUID | None:
    try:
        return uuid.UUID(member.decode() if isinstance(member, bytes) else member)
    except ValueError:
        logger.warning("ignoring malformed key usage member %r", member)
        return None
