"""Template filters of the console: one way to print bytes everywhere (binary units, as quotas are set)."""

from django import template

from kcaas.units import human_bytes as _human_bytes

register = template.Library()


@register.filter(name="human_bytes")
def human_bytes(count) -> str:
    """12884901888 -> "12 GiB". Not a number: shown as it is."""
    try:
        return _human_bytes(int(count))
    except (TypeError, ValueError):
        return str(count)
