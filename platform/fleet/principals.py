"""The identity of an authenticated node agent on node endpoints (request.user)."""

from dataclasses import dataclass

from audit.context import Actor
from fleet.models import Node


@dataclass(frozen=True, slots=True)
class NodePrincipal:
    """A node agent authenticated by its credential. Never staff, never a tenant: it passes only `IsNode`."""

    node: Node

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    @property
    def audit_actor(self) -> Actor:
        return Actor("node", str(self.node.pk))

    @property
    def pk(self):
        return self.node.pk

    id = pk

    def get_username(self) -> str:
        return f"node:{self.node.name}"

    def __str__(self) -> str:
        return f"node:{self.node.name}"
