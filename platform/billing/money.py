"""Meters and money: base units -> meter quantities and amounts, in Decimal only (never float).

- 1 GB = 10^9 bytes; GB-hours = byte-seconds / (3600 x 10^9); write GB = bytes / 10^9; read million tokens =
  tokens / 10^6.
- Quantities and line amounts are computed at PRECISION significant digits and kept to AMOUNT_PLACES (30)
  decimal places, ROUND_HALF_EVEN there. GB-hours are exact whenever the byte-seconds are a multiple of 9
  (3.6e12 = 2^13 x 3^2 x 5^11), write GB and million tokens always; otherwise the error is below 10^-30, far below
  the cent the invoice total is rounded to, once (ROUND_HALF_EVEN).
"""

from __future__ import annotations

import decimal
from decimal import ROUND_HALF_EVEN, Decimal

from billing.models import AMOUNT_PLACES

PRECISION = 80
BYTE_SECONDS_PER_GB_HOUR = 3600 * 10**9
BYTES_PER_GB = 10**9
TOKENS_PER_MILLION = 10**6
CENT = Decimal("0.01")
_PLACES = Decimal(1).scaleb(-AMOUNT_PLACES)

# meter -> (LedgerHour field holding its base units, base units per meter unit)
METER_SOURCES: dict[str, tuple[str, int]] = {
    "device_gb_hour": ("device_byte_seconds", BYTE_SECONDS_PER_GB_HOUR),
    "dram_gb_hour": ("dram_byte_seconds", BYTE_SECONDS_PER_GB_HOUR),
    "ssd_gb_hour": ("ssd_byte_seconds", BYTE_SECONDS_PER_GB_HOUR),
    "network_gb_hour": ("network_byte_seconds", BYTE_SECONDS_PER_GB_HOUR),
    "write_gb": ("bytes_written", BYTES_PER_GB),
    "read_million_tokens": ("tokens_served", TOKENS_PER_MILLION),
}


def _context() -> decimal.Context:
    return decimal.Context(prec=PRECISION, rounding=ROUND_HALF_EVEN)


def ratio(numerator: int | Decimal, denominator: int) -> Decimal:
    """numerator / denominator kept to AMOUNT_PLACES places, trailing zeros dropped (3.5, not 3.500...)."""
    context = _context()
    quotient = context.divide(Decimal(numerator), Decimal(denominator))
    return _plain(quotient.quantize(_PLACES, context=context))


def _plain(value: Decimal) -> Decimal:
    """Without trailing zeros, never in exponent form (Decimal('1E+1') -> Decimal('10'))."""
    if value == 0:
        return Decimal(0)
    normal = value.normalize(_context())
    return normal.quantize(Decimal(1)) if normal.as_tuple().exponent > 0 else normal


def decimal_text(value: Decimal) -> str:
    """The exact text of a Decimal, positional, without trailing zeros: "3.5", "0.0000000000016", never "1E-12"."""
    return format(_plain(Decimal(value)), "f")


def gb_hours(byte_seconds: int) -> Decimal:
    return ratio(byte_seconds, BYTE_SECONDS_PER_GB_HOUR)


def quantity(meter: str, usage: int) -> Decimal:
    """The meter-unit quantity of `usage` base units."""
    return ratio(usage, METER_SOURCES[meter][1])


def amount(meter: str, usage: int, unit_price: Decimal) -> Decimal:
    """usage x unit_price / units, divided once (so the amount is as exact as the quantity allows)."""
    context = _context()
    return ratio(context.multiply(Decimal(usage), Decimal(unit_price)), METER_SOURCES[meter][1])


def round_total(subtotal: Decimal) -> Decimal:
    """The invoice total: the sum of unrounded line amounts, rounded once to the cent, half to even."""
    return Decimal(subtotal).quantize(CENT, rounding=ROUND_HALF_EVEN)
