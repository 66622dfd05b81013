"""What the `kcaas` command line (kcaas/cli.py) prints: byte sizes, times, tables that fit TABLE_WIDTH columns, short
ids, JSON documents, and the writer that puts results on stdout and everything else, scrubbed of the API key, on
stderr. Errors are rendered by kcaas/cli_errors.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from kcaas import units

TABLE_WIDTH = 100  # every table fits a 100-column terminal unless --wide
SHORT_ID_LENGTH = 8  # ids in tables: the shortest unique prefix of at least this many characters
ELLIPSIS = "..."
KEY_SHAPE = re.compile(r"\b(kc_[a-z]{1,16}_[0-9A-Za-z]+)_[0-9A-Za-z]+")  # core/keys.py: prefix_public_secret
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS.update({f"{u}ib": v for u, v in _UNITS.items() if u not in ("", "b")})
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_bytes(text: str) -> int:
    """`1048576`, `512MiB`, `2G` (K/M/G/T and KiB.. are powers of 1024; kB/MB/GB/TB of 1000) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1048576, 512MiB, 2GiB)")
    return int(float(match.group(1)) * unit)


def human_bytes(value: int | None) -> str:
    """1536 -> `1.5 KiB` (kcaas.units); exact below 1 KiB; `-` for None."""
    return "-" if value is None else units.human_bytes(value)


def when(value: datetime | None, *, seconds: bool = True) -> str:
    """A local time, to the second (or, in tables, to the minute); `-` for none."""
    if not value:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def short_ids(ids: Iterable[str]) -> dict[str, str]:
    """id -> its shortest prefix of at least SHORT_ID_LENGTH characters that no other of `ids` starts with (as git
    abbreviates commits); `kcaas show` and the other commands accept such a prefix."""
    every = sorted(set(ids))
    short = {}
    for i, full in enumerate(every):
        neighbours = every[max(0, i - 1) : i] + every[i + 1 : i + 2]  # sorted: the longest shared prefix is there
        shared = max((_common_prefix(full, other) for other in neighbours), default=0)
        short[full] = full[: max(SHORT_ID_LENGTH, shared + 1)]
    return short


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def elide(text: str, width: int) -> str:
    """`text` cut to `width` columns, ending in `...` when cut."""
    if len(text) <= width:
        return text
    return text[: max(0, width - len(ELLIPSIS))] + ELLIPSIS


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, width: int | None = TABLE_WIDTH, elidable=()
) -> str:
    """Aligned columns. With a `width`, the columns named in `elidable` (header names) are narrowed, the widest
    first, until every line fits; their cut cells end in `...`."""
    cells = [list(headers)] + [["-" if v in (None, "") else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    if width is not None:
        _fit(widths, [headers.index(name) for name in elidable], width)
    lines = ("  ".join(elide(c, w).ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
    return "\n".join(lines)


def _fit(widths: list[int], elidable: list[int], width: int) -> None:
    floor = len(ELLIPSIS) + 5  # a cut cell keeps a few characters
    while sum(widths) + 2 * (len(widths) - 1) > width:
        narrowable = [i for i in elidable if widths[i] > floor]
        if not narrowable:
            return
        widths[max(narrowable, key=lambda i: widths[i])] -= 1


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class Out:
    """Where a command writes: stdout for results, stderr (scrubbed of the API key) for everything else."""

    def __init__(self, json_mode: bool, api_key: str | None) -> None:
        self.json_mode = json_mode
        self._api_key = api_key
        self.interactive = sys.stderr.isatty()

    def scrub(self, text: str) -> str:
        key = self._api_key or ""
        if len(key) >= 8:  # (a shorter "key" is no secret, and would garble the text)
            text = text.replace(key, "***")
        return KEY_SHAPE.sub(r"\1_***", text)

    def result(self, data: Any, human: Callable[[], str]) -> None:
        text = json.dumps(jsonable(data), indent=2, sort_keys=True) if self.json_mode else human()
        if text:
            print(text, file=sys.stdout, flush=True)

    def note(self, text: str, *, end: str = "\n") -> None:
        print(self.scrub(text), end=end, file=sys.stderr, flush=True)
