"""The caches' SSD directories under a node's SSD root, as the registry manages them (gpu_node/registry.py):
which exist, which epoch of a cache wrote one, and their removal.

A cache directory is `<root>/<cache id>/` holding the tiers' owner file (gpu_node.tiers.OWNER_FILE); nothing else
under the root is ever touched. Next to it the registry records the epoch that last provisioned it (EPOCH_FILE),
so a stale detach (an older epoch) never deletes the directory of a newer incarnation.

Removal is two steps: `take` renames the directory out of the way (atomic, quick: the registry does it under its
lock, so no provisioning can open the directory meanwhile), `delete` removes the renamed tree afterwards (slow:
outside the lock). A crash between them leaves a `.removed-*` entry, which the next `delete_leftovers` clears.
"""

from __future__ import annotations

import os
import shutil
import uuid

from gpu_node import tiers

EPOCH_FILE = "epoch"
REMOVED_PREFIX = ".removed-"


def names(root: str) -> list[str]:
    """Cache ids that have a directory under `root` (sorted)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    owned = (n for n in entries if os.path.isfile(os.path.join(root, n, tiers.OWNER_FILE)))
    return sorted(n for n in owned if not n.startswith("."))


def directory(root: str, cache_id: str) -> str | None:
    """The cache's directory path, or None for an id that cannot name one."""
    try:
        return tiers.cache_directory(root, cache_id)
    except ValueError:
        return None


def record_epoch(root: str, cache_id: str, epoch: int) -> None:
    """Note which epoch provisioned the cache's directory (when it has one)."""
    path = directory(root, cache_id)
    if path is None or not os.path.isdir(path):
        return
    target = os.path.join(path, EPOCH_FILE)
    with open(target + ".tmp", "w") as file:
        file.write(str(int(epoch)))
    os.replace(target + ".tmp", target)


def recorded_epoch(root: str, cache_id: str) -> int | None:
    path = directory(root, cache_id)
    try:
        with open(os.path.join(path, EPOCH_FILE)) as file:
            return int(file.read().strip())
    except (OSError, TypeError, ValueError):
        return None  # none recorded (written before epochs were recorded, or no directory)


def take(root: str, cache_id: str, *, epoch: int | None = None) -> str | None:
    """Rename the cache's directory out of the way; returns the new path for `delete`, or None when there is none
    or (with `epoch`) a newer epoch than `epoch` provisioned it."""
    path = directory(root, cache_id)
    if path is None or not os.path.isdir(path):
        return None
    if epoch is not None and (recorded_epoch(root, cache_id) or 0) > epoch:
        return None
    removed = os.path.join(root, f"{REMOVED_PREFIX}{cache_id}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, removed)
    except OSError:
        return None
    return removed


def delete(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def delete_leftovers(root: str) -> None:
    """Finish removals a crash interrupted (renamed, not yet deleted)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for name in entries:
        if name.startswith(REMOVED_PREFIX):
            delete(os.path.join(root, name))
