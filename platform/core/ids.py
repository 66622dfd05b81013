"""Ids from requests: one rule for every room."""

import uuid


def as_uuid(value) -> uuid.UUID | None:
    """The UUID a value spells, or None: a malformed id finds nothing, exactly like an unknown one (no 500, and no
    difference a caller could use to tell them apart)."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None
