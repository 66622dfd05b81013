"""Sizes as people read them, shared by the CLI, the console and the control plane's error messages (stdlib only)."""

from __future__ import annotations

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(count: int) -> str:
    """Bytes in binary units with at most one decimal: 512 B, 3.2 GiB, 16 GiB, 1 PiB."""
    count = int(count)
    if abs(count) < 1024:
        return f"{count} B"
    exponent = min((abs(count).bit_length() - 1) // 10, len(BINARY_UNITS) - 1)
    value = count / 1024**exponent
    if abs(value) >= 1023.95 and exponent < len(BINARY_UNITS) - 1:  # 1023.99 GiB would print as "1024.0 GiB"
        exponent, value = exponent + 1, value / 1024
    text = f"{value:.1f}".removesuffix(".0")
    return f"{text} {BINARY_UNITS[exponent]}"


def exact_and_human(count: int) -> str:
    """`452984832 bytes (432 MiB)`: the exact count a program reads, and the size a person reads, side by side."""
    return f"{int(count)} bytes ({human_bytes(count)})"
