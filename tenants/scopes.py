"""Key scopes: ``<resource>:<action>`` with resource in caches|keys|usage|audit and action in read|write.

Invariant: ``write`` implies ``read`` for the same resource; nothing else implies anything.
"""

from __future__ import annotations

from collections.abc import Iterable

RESOURCES = ("caches", "keys", "usage", "audit")
ACTIONS = ("read", "write")
ALL_SCOPES = tuple(f"{resource}:{action}" for resource in RESOURCES for action in ACTIONS)


class InvalidScope(ValueError):
    """A scope string that is not one of ALL_SCOPES."""


def normalize_scopes(scopes: Iterable[str]) -> list[str]:
    """Validated, de-duplicated, sorted scopes; raise InvalidScope naming the first unknown one."""
    result = set()
    for scope in scopes:
        if scope not in ALL_SCOPES:
            raise InvalidScope(scope)
        result.add(scope)
    return sorted(result)


def grants(held: Iterable[str], resource: str, action: str) -> bool:
    """Whether the held scopes allow ``action`` on ``resource`` (write implies read)."""
    held = set(held)
    if f"{resource}:{action}" in held:
        return True
    return action == "read" and f"{resource}:write" in held


def covers(held: Iterable[str], requested: Iterable[str]) -> bool:
    """Whether every requested scope is granted by the held ones (no key can mint a stronger key)."""
    held = set(held)
    for scope in requested:
        resource, _, action = scope.partition(":")
        if not grants(held, resource, action):
            return False
    return True
