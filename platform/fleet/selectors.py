"""Reads of the node registry. Writes live in fleet.services."""

import uuid

from django.db.models import QuerySet

from controlplane.errors import NotFoundError
from fleet.models import Node


def node_list(*, state: str | None = None) -> QuerySet[Node]:
    """All nodes ordered by name, optionally only those in one state."""
    nodes = Node.objects.order_by("name", "id")
    if state is not None:
        nodes = nodes.filter(state=state)
    return nodes


def node_get(*, node_id: uuid.UUID) -> Node:
    """The node, or a 404 `not_found`."""
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise NotFoundError("No such node.", details={"node_id": str(node_id)})
    return node


def node_get_by_credential(*, public_id: str) -> Node | None:
    """The node whose credential has this public id (the authentication lookup), or None."""
    return Node.objects.filter(credential_public_id=public_id).first()
