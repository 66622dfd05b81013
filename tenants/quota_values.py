"""Quota limit values as people write them: the one parser behind the REST API (PATCH .../quota) and the console.

A value is an integer, or a string: a whole number without leading zeros, and for the byte limits (max_device_bytes,
max_dram_bytes, max_ssd_bytes, max_network_bytes) optionally a binary unit after it, with or without a space, in any
case: "1GiB", "512 MiB", "3tib". Nothing else is a quota value: no decimals ("1.5GiB"), no signs, no SI units
("1GB"), no units on counts ("5GiB" of caches), no booleans. The result must lie within the field's bounds
(tenants.services.QUOTA_BOUNDS).

The strings taken are exactly those `string_pattern` matches, which the OpenAPI schema publishes: per unit, only as
many digits as always fit the upper bound (so a schema-valid string is never out of bounds; the largest values are
written as integers). Blank and null (the default) are the callers' business: a form field cannot be null, a JSON
body can.
"""

from __future__ import annotations

import re

BYTE_FIELDS = ("max_device_bytes", "max_dram_bytes", "max_ssd_bytes", "max_network_bytes")
BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
_PARTS = re.compile(r"([0-9]+) ?([a-z]*)")


class QuotaValueError(ValueError):
    """Not a value for this limit; str(error) says what is expected, in words fit for the caller."""


def string_pattern(field: str, bounds: tuple[int, int]) -> str:
    """The regular expression (JSON Schema / ECMA dialect) of the strings this field takes."""
    low, high = bounds
    assert low in (0, 1), "a string pattern only encodes lower bounds of 0 or 1"
    units = BYTE_UNITS if field in BYTE_FIELDS else {"": 1}
    alternatives = []
    for unit, size in units.items():
        digits = len(str(high // size)) - 1  # every number of this many digits, times size, is <= high
        if digits < 1:
            continue
        rest = f"[0-9]{{0,{digits - 1}}}"
        number = f"[1-9]{rest}" if low == 1 else f"(?:0|[1-9]{rest})"
        suffix = " ?" + "".join(f"[{c.upper()}{c}]" for c in unit) if unit else ""
        alternatives.append(number + suffix)
    return "^(?:" + "|".join(alternatives) + ")$"


def quota_value_parse(field: str, value: object, *, bounds: tuple[int, int]) -> int:
    """`value` (int or str) as the integer limit for `field`, checked against the inclusive `bounds`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise QuotaValueError(_expected(field))
    number = value if isinstance(value, int) else _number(field, value, bounds)
    low, high = bounds
    if not low <= number <= high:
        raise QuotaValueError(f"Between {low} and {high}.")
    return number


def _number(field: str, text: str, bounds: tuple[int, int]) -> int:
    if re.search(string_pattern(field, bounds), text) is None:
        low, high = bounds
        raise QuotaValueError(f"{_expected(field)} Between {low} and {high} (the largest values as integers).")
    parts = _PARTS.match(text.strip().lower())
    assert parts is not None  # the pattern matched
    return int(parts.group(1)) * BYTE_UNITS[parts.group(2)]


def _expected(field: str) -> str:
    if field in BYTE_FIELDS:
        return 'A whole number of bytes, optionally with a unit (KiB, MiB, GiB, TiB, PiB): 1073741824 or "1GiB".'
    return "A whole number."
