"""The fleet's network store as the control plane sees it: one pool of KCAAS_NETWORK_STORE_BYTES that caches ask a
share of (capacity.network), unlike device/dram/ssd, which are a node's and reserved by placement (fleet).

Invariants:
- the bytes in use are the sum of `network_capacity_bytes` over the caches not detached (a failed cache keeps its
  share: its objects stay in the store, and a cache whose node was lost is recovered from them); detaching gives
  the share back, with no bookkeeping of its own to drift;
- a share is granted only under NETWORK_STORE_LOCK (a PostgreSQL advisory lock held to the end of the transaction;
  SQLite serializes transactions anyway), so two attaches of different tenants never pass the store's size together.
  Lock order: it is taken after the tenant's lock and before any node's (caches.services' order);
- with KCAAS_NETWORK_STORE_BYTES = 0 there is no network tier: asking for network bytes is 409 network_tier_absent;
  asking for more than is left is 503 no_capacity, the fleet's placement refusal's shape (`requested`,
  `largest_free`, `hint`) for the tier `network`.
"""

from __future__ import annotations

from django.conf import settings
from django.db import connection
from django.db.models import Sum

from caches.errors import InvalidCapacity, NetworkTierAbsent
from caches.models import Cache, CacheState
from fleet.errors import NoCapacity
from fleet.selectors import TierUse, fleet_network_resident_bytes
from kcaas.units import human_bytes

NETWORK_STORE_LOCK = 0x6B63_6E65_7477  # pg advisory lock key ("kcnetw"): one share granted at a time
STORE_SETTING = "KCAAS_NETWORK_STORE_BYTES"


def network_store_bytes() -> int:
    """The store's size (bytes); 0: no network tier configured."""
    return int(settings.KCAAS_NETWORK_STORE_BYTES)


def network_store_in_use() -> int:
    """Bytes of the store granted to caches that are not detached."""
    total = Cache.objects.exclude(state=CacheState.DETACHED).aggregate(total=Sum("network_capacity_bytes"))["total"]
    return int(total or 0)


def network_tier_require() -> None:
    """409 network_tier_absent unless the fleet has a network store."""
    if network_store_bytes() <= 0:
        raise NetworkTierAbsent(
            "The fleet has no network tier: ask for capacity.network 0, or configure the network store.",
            details={"hint": f"The control plane's {STORE_SETTING} sizes the fleet's network store (bytes; 0: none)."},
        )


def network_store_reserve(*, nbytes: int) -> None:
    """Grant `nbytes` of the store to a cache created in this transaction (0: nothing to do). Refusals: 409
    network_tier_absent, 503 no_capacity with largest_free {"network": bytes left}."""
    if nbytes <= 0:
        return
    network_tier_require()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [NETWORK_STORE_LOCK])
    size = network_store_bytes()
    free = max(0, size - network_store_in_use())
    if nbytes > free:
        raise NoCapacity(
            f"The fleet's network store has not that many bytes left (network {human_bytes(nbytes)} asked, "
            f"{human_bytes(free)} free). Ask for at most `largest_free` network bytes, or give the store more "
            f"({STORE_SETTING}).",
            details={
                "requested": {"network": nbytes},
                "largest_free": {"network": free},
                "hint": f"The control plane's {STORE_SETTING} sizes the fleet's network store (bytes).",
            },
        )


def write_through_check(*, capacity: dict[str, int], network_write_through: object) -> None:
    """400 invalid_capacity unless `network_write_through` is a bool, and true only with network bytes."""
    if not isinstance(network_write_through, bool):
        problem = "must be true or false"
    elif network_write_through and not capacity.get("network"):
        problem = "needs a network tier (capacity.network above 0)"
    else:
        return
    raise InvalidCapacity(
        f"network_write_through {problem}.", details={"fields": {"network_write_through": [problem.capitalize()]}}
    )


def network_tier_use() -> TierUse:
    """The network store as one more tier of the fleet (the console's overview): its size, the bytes granted to
    caches, and the bytes live nodes report their caches hold in it."""
    return TierUse("network", network_store_bytes(), network_store_in_use(), fleet_network_resident_bytes())
