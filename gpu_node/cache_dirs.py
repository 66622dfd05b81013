"""The caches' SSD directories under a node's SSD root (KCAAS_NODE_SSD_DIR), as the tiers open them and the registry
manages them (gpu_node/registry.py): where they are, whose they are, which exist, which epoch of a cache wrote one,
and their removal.

A cache directory is `<root>/<cache id>/` holding its owner file (OWNER_FILE: the tenant id, so purge_tenant finds
directories of caches not hosted now); nothing else under the root is ever touched. Next to it the registry records
the epoch that last provisioned it (EPOCH_FILE), so a stale detach (an older epoch) never deletes the directory of a
newer incarnation.

Removal is two steps: `take` renames the directory out of the way (atomic, quick: the registry does it under its
lock, so no provisioning can open the directory meanwhile), `delete` removes the renamed tree afterwards (slow:
outside the lock). A crash between them leaves a `.removed-*` entry, which the next `delete_leftovers` clears.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

SSD_DIR_ENV = "KCAAS_NODE_SSD_DIR"
OWNER_FILE = "tenant"
EPOCH_FILE = "epoch"
REMOVED_PREFIX = ".removed-"
_SAFE_CACHE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def default_ssd_root(environ=os.environ) -> str:
    """KCAAS_NODE_SSD_DIR, else var/kcaas-ssd under the agent's working directory."""
    return environ.get(SSD_DIR_ENV) or os.path.join(os.getcwd(), "var", "kcaas-ssd")


def cache_directory(ssd_root: str, cache_id: str) -> str:
    if not _SAFE_CACHE_ID.fullmatch(cache_id):
        raise ValueError("a cache id must be a plain file name to name its SSD directory")
    return os.path.join(ssd_root, cache_id)


def _write_atomically(path: str, text: str) -> None:
    """temp file, fsync, rename: a crash leaves the old content or the new."""
    with open(path + ".tmp", "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def write_owner(directory: str, tenant_id: str) -> None:
    _write_atomically(os.path.join(directory, OWNER_FILE), tenant_id)


def _owner(root: str, name: str) -> str | None:
    try:
        with open(os.path.join(root, name, OWNER_FILE)) as file:
            return file.read()
    except OSError:
        return None


def names(root: str) -> list[str]:
    """Cache ids that have a directory under `root` (sorted)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    owned = (n for n in entries if os.path.isfile(os.path.join(root, n, OWNER_FILE)))
    return sorted(n for n in owned if not n.startswith("."))


def directory(root: str, cache_id: str) -> str | None:
    """The cache's directory path, or None for an id that cannot name one."""
    try:
        return cache_directory(root, cache_id)
    except ValueError:
        return None


def record_epoch(root: str, cache_id: str, epoch: int) -> None:
    """Note which epoch provisioned the cache's directory (when it has one)."""
    path = directory(root, cache_id)
    if path is None or not os.path.isdir(path):
        return
    _write_atomically(os.path.join(path, EPOCH_FILE), str(int(epoch)))


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


def purge_tenant_directories(root: str, tenant_id: str) -> list[str]:
    """Delete every cache directory under `root` owned by the tenant (hosted or left from an earlier run)."""
    if not tenant_id:
        return []
    removed = [name for name in names(root) if _owner(root, name) == tenant_id]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed
