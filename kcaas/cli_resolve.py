"""Naming caches and keys on the `kcaas` command line (kcaas/cli.py): wherever an id is taken, so is a name or an id
prefix (as `kcaas ls` and `kcaas keys ls` print them).

A full id is used as given (the server answers for it). Otherwise names win over id prefixes: the items whose name
(or, for keys, public id) is the reference; among several, the live ones (a cache not detached, an active key); else
the items whose id starts with the reference (at least MIN_PREFIX characters). One match is the answer; none is a
`not_found` error, several an `ambiguous` one listing them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kcaas.errors import KcaasError, NotFoundError

MIN_PREFIX = 4
_FULL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)

Item = TypeVar("Item")


def is_full_id(reference: str) -> bool:
    return bool(_FULL_ID.fullmatch(reference))


def resolve(
    reference: str,
    items: Sequence[Item],
    *,
    what: str,
    names: Callable[[Item], Iterable[str]],
    live: Callable[[Item], bool],
) -> Item:
    """The one item of `items` that `reference` names (see the module docstring); raises NotFoundError or an
    `ambiguous` KcaasError."""
    named = [item for item in items if reference in names(item)]
    if len(named) > 1:
        named = [item for item in named if live(item)] or named
    matches = named or _by_prefix(reference, items)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFoundError(
            f"No {what} is named {reference!r} or has an id starting with it.",
            code="not_found",
            details={what: reference},
        )
    listed = [f"{_id(item)} {_label(item)}" for item in matches]
    raise KcaasError(f"{len(matches)} {what}s match {reference!r}.", code="ambiguous", details={"matches": listed})


def _by_prefix(reference: str, items: Sequence[Any]) -> list[Any]:
    if len(reference) < MIN_PREFIX:
        return []
    prefix = reference.lower()
    return [item for item in items if _id(item).lower().startswith(prefix)]


def _id(item: Any) -> str:
    return str(item.id)


def _label(item: Any) -> str:
    return f"{item.name or '-'} ({item.state})"


def cache_id(client: Any, reference: str) -> str:
    """The id of the tenant's cache that `reference` names (a full id is not looked up)."""
    if is_full_id(reference):
        return reference
    caches = client.list_caches()
    found = resolve(reference, caches, what="cache", names=lambda c: (c.name,), live=lambda c: c.state != "detached")
    return str(found.id)


def key_id(client: Any, reference: str) -> str:
    """The id of the tenant's API key that `reference` names: by id, id prefix, name or public id."""
    if is_full_id(reference):
        return reference
    keys = client.list_keys()
    found = resolve(
        reference, keys, what="key", names=lambda k: (k.name, k.public_id), live=lambda k: k.state == "active"
    )
    return str(found.id)
