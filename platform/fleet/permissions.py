"""Node endpoints admit node agents only: not staff, not tenant keys."""

from rest_framework.permissions import BasePermission

from fleet.principals import NodePrincipal


class IsNode(BasePermission):
    message = "This endpoint needs a node credential."

    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, NodePrincipal)
