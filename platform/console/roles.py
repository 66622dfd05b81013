"""Console roles: Django groups a staff user belongs to, and what each may do.

| capability      | operator | compliance | read-only |
|-----------------|----------|------------|-----------|
| view            | yes      | yes        | yes       |
| tenants.edit    | yes      |            |           |  quota edit, key revoke
| nodes.edit      | yes      |            |           |  cordon, uncordon, drain
| audit.export    |          | yes        |           |  export, verify an upload
| gdpr.edit       |          | yes        |           |  erasure request/cancel, receipts, portability exports

A superuser holds every capability. A user with no console role (or not staff) cannot sign in to the console.
Console users never authenticate to the REST API with their password or console session
(controlplane.authentication): the second factor and the roles would be bypassed there.
"""

from __future__ import annotations

OPERATOR, COMPLIANCE, READ_ONLY = "operator", "compliance", "read-only"
ROLES = (OPERATOR, COMPLIANCE, READ_ONLY)
GROUP_PREFIX = "console:"

CAPABILITIES: dict[str, frozenset[str]] = {
    "view": frozenset(ROLES),
    "tenants.edit": frozenset({OPERATOR}),
    "nodes.edit": frozenset({OPERATOR}),
    "audit.export": frozenset({COMPLIANCE}),
    "gdpr.edit": frozenset({COMPLIANCE}),
}


def group_name(role: str) -> str:
    assert role in ROLES, f"unknown console role {role!r}"
    return GROUP_PREFIX + role


def user_roles(user) -> frozenset[str]:
    """The console roles of a staff user (all of them for a superuser); empty for anyone else."""
    if user is None or not getattr(user, "is_authenticated", False) or not getattr(user, "is_staff", False):
        return frozenset()
    if not hasattr(user, "groups"):  # an API key or node principal
        return frozenset()
    if user.is_superuser:
        return frozenset(ROLES)
    cached = getattr(user, "_console_roles", None)
    if cached is None:
        names = user.groups.filter(name__startswith=GROUP_PREFIX).values_list("name", flat=True)
        cached = frozenset(name[len(GROUP_PREFIX) :] for name in names if name[len(GROUP_PREFIX) :] in ROLES)
        user._console_roles = cached
    return cached


def has_console_role(user) -> bool:
    return bool(user_roles(user))


def can(user, capability: str) -> bool:
    assert capability in CAPABILITIES, f"unknown console capability {capability!r}"
    return bool(user_roles(user) & CAPABILITIES[capability])


def capabilities(user) -> dict[str, bool]:
    """{'tenants_edit': True, ...} for templates (dots are attribute lookups there)."""
    return {name.replace(".", "_"): can(user, name) for name in CAPABILITIES}
