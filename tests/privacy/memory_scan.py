"""Searching another process's memory for bytes (Linux: /proc/<pid>/maps + /proc/<pid>/mem, readable by root or a
parent allowed to ptrace its child). Used to prove that erased KV left no plaintext copy in a node agent: pools,
freed heap, thread arenas, anonymous mappings, stacks."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_MAPS_LINE = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)")
_CHUNK = 64 << 20
_SKIPPED = ("[vvar]", "[vsyscall]", "[vvar_vclock]")  # not readable through /proc/<pid>/mem


@dataclass(frozen=True, slots=True)
class Hit:
    address: int
    region: str  # the mapping's path or pseudo-name ("" for an anonymous mapping), with its bounds


def readable(pid: int) -> bool:
    """Whether this process may read `pid`'s memory (root, or ptrace allowed)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            start = int(maps.readline().split("-")[0], 16)
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(start)
            mem.read(1)
        return True
    except OSError:
        return False


def _writable_regions(pid: int) -> list[tuple[int, int, str]]:
    """Private writable mappings: where a process's own data lives (heap, arenas, anonymous maps, stacks, the
    writable pages of libraries). Read-only file mappings hold what is on disk, not what the process received."""
    regions = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            match = _MAPS_LINE.match(line.strip())
            if match is None:
                continue
            start, end, perms, name = int(match[1], 16), int(match[2], 16), match[3], match[4]
            if perms[0] == "r" and perms[1] == "w" and name not in _SKIPPED:
                regions.append((start, end, f"{name} {match[1]}-{match[2]}"))
    return regions


def find_bytes(pid: int, needle: bytes, *, limit: int = 16) -> list[Hit]:
    """Addresses (at most `limit`) in `pid`'s writable memory where `needle` occurs. Regions that cannot be read
    (unmapped meanwhile, guard pages) are skipped."""
    hits: list[Hit] = []
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        for start, end, name in _writable_regions(pid):
            pos = start
            while pos < end and len(hits) < limit:
                size = min(_CHUNK, end - pos)
                try:
                    data = os.pread(fd, size + len(needle) - 1 if pos + size < end else size, pos)
                except OSError:
                    break
                found = data.find(needle)
                while found != -1 and len(hits) < limit:
                    hits.append(Hit(pos + found, name))
                    found = data.find(needle, found + 1)
                pos += size
    finally:
        os.close(fd)
    return hits


def _pread_mapped(fd: int, length: int, address: int) -> bytes:
    """The bytes at `address` in the process's memory, or b"" where nothing is mapped (EIO: past a mapping's end, or
    before its start)."""
    try:
        return os.pread(fd, length, address)
    except OSError:
        return b""


def describe(pid: int, hit: Hit, needle: bytes) -> str:
    """How many needles in a row start at the hit, and the 16 bytes before them (for a failure message)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        before = _pread_mapped(fd, 16, hit.address - 16)  # nothing when the hit starts its mapping
        run, pos = 0, hit.address
        while _pread_mapped(fd, len(needle), pos) == needle:
            run, pos = run + 1, pos + len(needle)
    finally:
        os.close(fd)
    return f"{hit.address:#x} in [{hit.region}]: {run} x {len(needle)} bytes, after {before.hex()}"
