"""The caches room's refusals: each an ApplicationError with a stable code, rendered in the one error shape."""

from rest_framework import status

from core.errors import ApplicationError, ConflictError
from fleet.errors import InvalidCapacity  # noqa: F401  one refusal, one class: caches adds the one-block rule


class InvalidSpec(ApplicationError):
    """The KV identity/layout is invalid (unknown dtype, zero heads, ...); details name each field."""

    code = "invalid_spec"


class CacheNameTaken(ConflictError):
    code = "cache_name_taken"


class CacheNotReady(ConflictError):
    """The operation needs a `ready` cache (tokens: the node must be serving it)."""

    code = "cache_not_ready"


class InvalidIdempotencyKey(ApplicationError):
    code = "invalid_idempotency_key"


class IdempotencyKeyReused(ApplicationError):
    """Same Idempotency-Key, different request: refused rather than guessing which one the client meant."""

    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    code = "idempotency_key_reused"


class IdempotencyInProgress(ConflictError):
    """A request with this Idempotency-Key is still being processed; retry after it finishes."""

    code = "idempotency_in_progress"


class NetworkTierAbsent(ConflictError):
    """The cache asks for network bytes, but the fleet has no network store (KCAAS_NETWORK_STORE_BYTES is 0)."""

    code = "network_tier_absent"


class CacheNotRecoverable(ConflictError):
    """POST .../recover on a cache that is not failed with node_lost, or has no network tier to recover from."""

    code = "cache_not_recoverable"
