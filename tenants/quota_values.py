"""Quota limit values as people write them: the one parser behind every surface (PATCH .../quota, the console's
quota form, the CLI), one rule per field.

- Counts (max_caches, max_keys, rates, ...): a whole number, given as an integer. A JSON string is refused on the
  REST API, as everywhere else in it ("5", 5.0 and true are not integers).
- Byte limits (max_device_bytes, max_dram_bytes, max_ssd_bytes, max_network_bytes): an integer, or a string that
  names a binary unit: a whole number without leading zeros, then KiB, MiB, GiB, TiB, PiB or B, with or without a
  space, in any case ("1GiB", "512 MiB", "3tib"). A bare number in a string ("1073741824") is refused: give it as an
  integer. No decimals ("1.5GiB"), no signs, no SI units ("1GB"), no booleans.
The result must lie within the field's bounds (tenants.services.QUOTA_BOUNDS).

Text surfaces (a form field, a command-line argument) have no types: there the digits a person types are the
integer they mean, and the surface turns them into one before calling the parser (console.forms.parse_limit), so a
value is taken or refused alike wherever it is typed.

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


def takes_strings(field: str) -> bool:
    """Whether the field takes a string at all (byte limits with a unit); counts are integers only."""
    return field in BYTE_FIELDS


def string_pattern(field: str, bounds: tuple[int, int]) -> str:
    """The regular expression (JSON Schema / ECMA dialect) of the strings this byte field takes: each with its
    unit. ValueError for a count field, which takes no string."""
    if not takes_strings(field):
        raise ValueError(f"{field} takes integers only")
    low, high = bounds
    assert low in (0, 1), "a string pattern only encodes lower bounds of 0 or 1"
    alternatives = []
    for unit, size in BYTE_UNITS.items():
        if not unit:
            continue  # a bare number is an integer, never a string
        digits = len(str(high // size)) - 1  # every number of this many digits, times size, is <= high
        if digits < 1:
            continue
        rest = f"[0-9]{{0,{digits - 1}}}"
        number = f"[1-9]{rest}" if low == 1 else f"(?:0|[1-9]{rest})"
        suffix = " ?" + "".join(f"[{c.upper()}{c}]" for c in unit)
        alternatives.append(number + suffix)
    return "^(?:" + "|".join(alternatives) + ")$"


def quota_value_parse(field: str, value: object, *, bounds: tuple[int, int]) -> int:
    """`value` (int or str) as the integer limit for `field`, checked against the inclusive `bounds`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | str)
        or (isinstance(value, str) and not takes_strings(field))
    ):
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
        return (
            "A whole number of bytes as an integer, or a string with its unit (KiB, MiB, GiB, TiB, PiB): "
            '1073741824 or "1GiB".'
        )
    return "A whole number, as an integer."
