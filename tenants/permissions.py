"""Permissions: scopes for tenant keys, staff for administration.

ScopePermission reads ``view.scope_resource`` (caches|keys|usage|audit): SAFE methods need ``<resource>:read``, other
methods ``<resource>:write`` (write implies read). Staff users pass; node principals and anonymous callers never do.
A missing scope is 403 ``permission_denied`` with ``details.required_scope``.
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from controlplane.errors import ApplicationError
from tenants import scopes as scope_rules
from tenants.principals import TenantPrincipal, is_staff_user


class ImproperlyConfiguredView(RuntimeError):
    """A view using ScopePermission without a valid ``scope_resource``."""


class ScopePermission(BasePermission):
    def has_permission(self, request, view) -> bool:
        user = getattr(request, "user", None)
        if is_staff_user(user):
            return True
        if not isinstance(user, TenantPrincipal):
            return False  # DRF answers 401 for no credentials, 403 for other principals
        resource = getattr(view, "scope_resource", None)
        if resource not in scope_rules.RESOURCES:
            raise ImproperlyConfiguredView(f"{type(view).__name__}.scope_resource not in {scope_rules.RESOURCES}")
        action = "read" if request.method in SAFE_METHODS else "write"
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
