"""The caches' SSD directories under a node's SSD root (KCAAS_NODE_SSD_DIR), as the tiers open them and the registry
manages them (gpu_node/agent/registry.py): where they are, whose they are, which exist, which epoch of a cache wrote
one, and their removal.

A cache directory is `<root>/<cache id>/` holding its owner file (OWNER_FILE: the tenant id, so purge_tenant finds
directories of caches not hosted now); nothing else under the root is ever touched. Next to it the registry records
the epoch that last provisioned it (EPOCH_FILE), so a stale detach (an older epoch) never deletes the directory of a
newer incarnation.

Removal is two steps: `take` renames the directory out of the way (atomic, quick: the registry does it under its
lock, so no provisioning can open the directory meanwhile), `delete` removes the renamed tree afterwards (slow:
outside the lock). A crash between them leaves a `.removed-*` entry, which the next `delete_leftovers` clears.

Liveness (LOCK_FILE): an open SSD store holds an exclusive flock on `<dir>/lock` for its whole lifetime (`hold`,
released by `release` or by the process's death, so a SIGKILLed agent leaves no stale lock). A second store of the
same directory, in this process or another, is refused (DirectoryInUse). `take` and `purge_tenant_directories`
take that lock themselves (non-blocking) around the rename: a directory a live store holds is never renamed or
deleted (skipped, logged), and no store can open it while it is being renamed. Two agents given one SSD root
(KCAAS_NODE_SSD_DIR) therefore cannot corrupt or delete each other's live caches; they must still not share one,
since a directory of the other's that no store holds at that moment is fair game to registration's clean-up.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import uuid

from gpu_node.errors import NodeError
from gpu_node.tiers.durable_file import replace_file

SSD_DIR_ENV = "KCAAS_NODE_SSD_DIR"
OWNER_FILE = "tenant"
EPOCH_FILE = "epoch"
REMOVED_PREFIX = ".removed-"
LOCK_FILE = "lock"
_SAFE_CACHE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
log = logging.getLogger(__name__)


class DirectoryInUse(NodeError, RuntimeError):
    """Another live SSD store (of this process or another) holds the cache directory."""


def default_ssd_root(environ=os.environ) -> str:
    """KCAAS_NODE_SSD_DIR, else var/kcaas-ssd under the agent's working directory."""
    return environ.get(SSD_DIR_ENV) or os.path.join(os.getcwd(), "var", "kcaas-ssd")


def hold(directory: str) -> int:
    """Create `directory` if needed and lock it for one store: returns the fd whose exclusive flock on LOCK_FILE is
    the store's claim (keep it open for the store's lifetime, `release` it at close). Raises DirectoryInUse when a
    live store holds the directory. The lock is re-checked against the path after it is taken: when the directory
    was renamed away meanwhile (a removal), a fresh one is made and locked instead."""
    for _ in range(5):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # renamed away between makedirs and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUse(
                f"the SSD directory {directory} is held by another live store (a second agent with the same "
                f"KCAAS_NODE_SSD_DIR, or the same cache opened twice): refusing to open it"
            ) from None
        if _names_fd(path, fd):
            return fd
        os.close(fd)
    raise DirectoryInUse(f"the SSD directory {directory} kept being removed while it was opened")


def release(fd: int | None) -> None:
    """Let go of a directory `hold` locked (closing the fd drops the flock)."""
    if fd is not None:
        os.close(fd)


def held(directory: str) -> bool:
    """Whether a live store (of any process) holds `directory` now."""
    free, fd = _lock_if_free(directory)
    release(fd)
    return not free


def _names_fd(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _lock_if_free(directory: str) -> tuple[bool, int | None]:
    """(free, fd): free is False when a live store holds the directory; fd (when not None) is our own lock on it,
    which keeps stores out until it is released. A directory without a lock file was never held: free, no fd."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False, None
    return True, fd


def cache_directory(ssd_root: str, cache_id: str) -> str:
    if not _SAFE_CACHE_ID.fullmatch(cache_id):
        raise ValueError("a cache id must be a plain file name to name its SSD directory")
    return os.path.join(ssd_root, cache_id)


def write_owner(directory: str, tenant_id: str) -> None:
    """Record the tenant that owns a cache directory (durable_file: a crash leaves the old owner or the new)."""
    replace_file(os.path.join(directory, OWNER_FILE), tenant_id.encode())


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
    replace_file(os.path.join(path, EPOCH_FILE), str(int(epoch)).encode())


def recorded_epoch(root: str, cache_id: str) -> int | None:
    path = directory(root, cache_id)
    if path is None:
        return None  # an id that cannot name a directory
    try:
        with open(os.path.join(path, EPOCH_FILE)) as file:
            return int(file.read().strip())
    except (OSError, TypeError, ValueError):
        return None  # none recorded (written before epochs were recorded, or no directory)


def take(root: str, cache_id: str, *, epoch: int | None = None) -> str | None:
    """Rename the cache's directory out of the way; returns the new path for `delete`, or None when there is none,
    (with `epoch`) a newer epoch than `epoch` provisioned it, or a live store (of any process) holds it. The
    directory's lock is held across the rename, so no store opens it meanwhile."""
    path = directory(root, cache_id)
    if path is None or not os.path.isdir(path):
        return None
    if epoch is not None and (recorded_epoch(root, cache_id) or 0) > epoch:
        return None
    free, fd = _lock_if_free(path)
    if not free:
        log.warning("not removing the SSD directory %s: a live store holds it", path)
        return None
    removed = os.path.join(root, f"{REMOVED_PREFIX}{cache_id}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, removed)
    except OSError:
        return None
    finally:
        release(fd)
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
        path = os.path.join(root, name)
        if name.startswith(REMOVED_PREFIX) and not held(path):
            delete(path)


def purge_tenant_directories(root: str, tenant_id: str) -> list[str]:
    """Delete every cache directory under `root` owned by the tenant (hosted or left from an earlier run), except
    one a live store holds (this process's stores are wiped by the registry first; another process's are not ours
    to delete: skipped and logged). Returns the cache ids whose directory was deleted."""
    if not tenant_id:
        return []
    removed = []
    for name in names(root):
        if _owner(root, name) == tenant_id:
            taken = take(root, name)
            if taken is not None:
                delete(taken)
                removed.append(name)
    return removed
