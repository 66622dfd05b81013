"""Whole-file commits for the files the node rewrites (an SSD store's index, a cache directory's owner file, the
node's identity and sealing key): a crash leaves the old content or the new, and concurrent writers never collide.

    replace_file(path, data)    a temp file named for this write alone (mkstemp, beside `path`), written, fsync'd,
                                renamed over `path`, the directory fsync'd; two writers of one path each rename a
                                complete file of their own (the last rename wins), never one another's half-written
                                or already-renamed temp file
    CommittedFile(path).commit(snapshot)
                                replace_file serialized per file, the content taken by `snapshot()` inside the
                                serialization: a commit that started later never loses to one that started earlier
                                (an index written from an older snapshot would bring back entries a delete removed)

Temp files are named `.<name>.<random>.tmp`: `stale_temp_files` lists those a crash left behind, for their owner to
remove when it opens the directory.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def replace_file(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> None:
    """Atomically and durably make `data` the content of `path` (created `mode`, whatever the umask)."""
    target = Path(path)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    try:
        os.replace(temp, target)
    except BaseException:
        os.unlink(temp)
        raise
    fsync_directory(target.parent)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stale_temp_files(directory: str | os.PathLike, name: str) -> list[Path]:
    """The temp files of `name` in `directory` that a crash left behind (no live writer may be running)."""
    return sorted(Path(directory).glob(f".{name}.*{TEMP_SUFFIX}"))


class CommittedFile:
    """One file that several threads commit: each `commit` takes its content and writes it under one lock.

    Invariant: the file on disk is always the content of the last commit to finish, and commits finish in the
    order their snapshots were taken."""

    def __init__(self, path: str | os.PathLike, *, mode: int = 0o600):
        self.path = Path(path)
        self.mode = mode
        self._lock = threading.Lock()

    def commit(self, snapshot: Callable[[], bytes]) -> None:
        """Write `snapshot()` (called under this file's lock) as the file's new content."""
        with self._lock:
            replace_file(self.path, snapshot(), mode=self.mode)

    def remove_stale_temp_files(self) -> int:
        """Remove temp files of this file that a crash left behind (call before any commit); returns how many."""
        with self._lock:
            stale = stale_temp_files(self.path.parent, self.path.name)
            fixed_name = self.path.with_name(self.path.name + TEMP_SUFFIX)  # left by releases with one temp name
            stale += [fixed_name] if fixed_name.exists() else []
            for temp in stale:
                temp.unlink(missing_ok=True)
            return len(stale)
