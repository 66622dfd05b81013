"""Who is calling: a tenant's API key (TenantPrincipal) or a staff user (Django auth), and which tenant they act on.

Invariant: a tenant principal only ever acts on its own tenant; naming any other tenant gives 404, never 403, so a
tenant cannot learn whether another tenant's id exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rest_framework.exceptions import PermissionDenied

from audit.context import Actor
from core.errors import ApplicationError, NotFoundError
from core.ids import as_uuid
from core.permissions import is_staff_user as _is_staff_user
from tenants import scopes as scope_rules
from tenants.models import ApiKey, Tenant


@dataclass(frozen=True, eq=False)
class TenantPrincipal:
    """``request.user`` for a request authenticated with a tenant API key."""

    tenant: Tenant
    api_key: ApiKey
    scopes: frozenset[str] = field(default_factory=frozenset)

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    @property
    def pk(self):
        return self.api_key.pk

    id = pk

    def has_scope(self, resource: str, action: str) -> bool:
        return scope_rules.grants(self.scopes, resource, action)

    @staticmethod
    def valid_resource(resource) -> bool:
        """Whether a view's scope_resource names a resource keys can hold scopes on (core.permissions asks)."""
        return resource in scope_rules.RESOURCES

    @property
    def audit_actor(self) -> Actor:
        return Actor("key", self.api_key.public_id)

    def get_username(self) -> str:
        return f"key:{self.api_key.public_id}"

    def __str__(self) -> str:
        return f"tenant {self.tenant.name} via key {self.api_key.public_id}"


def is_staff_user(user) -> bool:
    """A Django auth user with is_staff (never a key or node principal): core.permissions' rule."""
    return _is_staff_user(user)


def request_tenant(request, tenant_id=None) -> Tenant:
    """The tenant this request acts on.

    Tenant principal: its own tenant; a ``tenant_id`` naming another (or no) tenant is a 404.
    Staff: the named tenant, which is required (400 ``tenant_required``); unknown is a 404.
    Anyone else (a node, an anonymous caller): 403.
    """
    user = getattr(request, "user", None)
    if isinstance(user, TenantPrincipal):
        if tenant_id is not None and as_uuid(tenant_id) != user.tenant.id:
            raise NotFoundError("No such tenant.")
        return user.tenant
    if is_staff_user(user):
        if tenant_id is None:
            raise ApplicationError(
                "Staff must name the tenant: add ?tenant_id=<uuid> to the URL.", code="tenant_required"
            )
        wanted = as_uuid(tenant_id)
        tenant = Tenant.objects.filter(pk=wanted).first() if wanted is not None else None
        if tenant is None:
            raise NotFoundError("No such tenant.")
        return tenant
    raise PermissionDenied("This endpoint is for tenants and staff.")
