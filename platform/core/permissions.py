"""Permissions: scopes for principals that carry them (tenant keys), staff for administration.

ScopePermission reads ``view.scope_resource`` (a resource name such as caches|keys|usage|audit): SAFE methods need
``<resource>:read``, other methods ``<resource>:write``. Staff users pass; principals without scopes (nodes) and
anonymous callers never do. A missing scope is 403 ``permission_denied`` with ``details.required_scope``.

The principal protocol (a tenant's TenantPrincipal implements it): ``has_scope(resource, action) -> bool`` and
``valid_resource(resource) -> bool``. This module imports no room: the tenants room owns what scopes mean.
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from core.errors import ApplicationError


class ImproperlyConfiguredView(RuntimeError):
    """A view using ScopePermission without a valid ``scope_resource``."""


def is_staff_user(user) -> bool:
    """A Django auth user with is_staff (never a principal that carries scopes: a key or a node)."""
    if user is None or hasattr(user, "has_scope"):
        return False
    return bool(getattr(user, "is_authenticated", False) and getattr(user, "is_staff", False))


class ScopePermission(BasePermission):
    def has_permission(self, request, view) -> bool:
        user = getattr(request, "user", None)
        if is_staff_user(user):
            return True
        if not hasattr(user, "has_scope"):
            return False  # DRF answers 401 for no credentials, 403 for other principals
        resource = getattr(view, "scope_resource", None)
        if not user.valid_resource(resource):
            raise ImproperlyConfiguredView(f"{type(view).__name__}.scope_resource {resource!r} is not a resource")
        # a view may name its action (a POST that only reads, like a lookup with a body, sets scope_action = "read")
        action = getattr(view, "scope_action", None) or ("read" if request.method in SAFE_METHODS else "write")
        if user.has_scope(resource, action):
            return True
        raise ApplicationError(
            f"This key lacks the {resource}:{action} scope.",
            code="permission_denied",
            status_code=403,
            details={"required_scope": f"{resource}:{action}"},
        )


class IsStaff(BasePermission):
    message = "Staff only."

    def has_permission(self, request, view) -> bool:
        return is_staff_user(getattr(request, "user", None))
