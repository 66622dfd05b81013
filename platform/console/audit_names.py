"""Names beside the ids an audit event holds (its actor, tenant and target), resolved for a whole page at once.

    audit_names(events)     one query per kind of object named on the page (console users, API keys, nodes,
                            tenants, caches), whatever the page's size; kinds nobody names are not queried
    AuditNames.actor(e)     a Ref for `actor_kind:actor_id` (user -> username, key -> key name and tenant,
                            node -> node name, system -> no id)
    AuditNames.tenant(e)    a Ref for the event's tenant id, or None when it has none
    AuditNames.target(e)    a Ref for `target_type:target_id` (tenant, quota -> tenant; api_key; cache -> cache name
                            and tenant; node; console_user -> username); other types keep the id alone

What a Ref may add to the event: the current name of an object that still exists, nothing else. An object that is
gone (deleted, or erased: erasure renames a tenant `erased-<pseudonym>`, its caches `erased` and blanks its keys'
names) is its id marked `gone` ("(deleted)" on the page), never its erased or former name. A pseudonymised event's
ids are pseudonyms that name no row, so they resolve to gone as well.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db.models import Q

from audit.models import AuditEvent
from caches.selectors import cache_list
from core.ids import as_uuid
from fleet.selectors import node_list
from tenants.models import ApiKey, Tenant
from tenants.selectors import tenant_list

SHORT_ID_CHARS = 8  # a UUID shows its first 8 hex digits; the full id is in the title and the details
LONGEST_SHOWN_WHOLE = 10  # ids up to this long (a user pk) are shown whole

# Which kind of object an actor kind or target type names: the id space Ref resolution looks it up in.
ACTOR_KIND_OBJECT = {"user": "user", "key": "key_public_id", "node": "node"}
TARGET_TYPE_OBJECT = {
    "tenant": "tenant",
    "quota": "tenant",  # a quota's id is its tenant's
    "api_key": "key",
    "cache": "cache",
    "node": "node",
    "console_user": "user",
}


def short_id(text: str) -> str:
    """`text` as the table shows it: whole when short, else its first SHORT_ID_CHARS characters and an ellipsis."""
    return text if len(text) <= LONGEST_SHOWN_WHOLE else text[:SHORT_ID_CHARS] + "…"


@dataclass(frozen=True, slots=True)
class Ref:
    """An id from an audit event and what the page may say about it."""

    kind: str  # the actor kind or target type, as the event holds it
    id: str  # the full id, as the event holds it ("" for the system actor or a target without id)
    name: str = ""  # the object's current name; "" when unknown, gone, or not a kind that has names
    owner: str = ""  # the name of the tenant an API key or a cache belongs to
    gone: bool = False  # a kind with names whose object no longer exists (deleted or erased)

    @property
    def full(self) -> str:
        """`kind:id` in full (the title of the shortened id, and what the actor filter takes)."""
        return f"{self.kind}:{self.id}" if self.id else self.kind

    @property
    def short(self) -> str:
        return f"{self.kind}:{short_id(self.id)}" if self.id else self.kind

    @property
    def short_id(self) -> str:
        return short_id(self.id)

    @property
    def text(self) -> str:
        """The name shown beside the id: "(deleted)" for a gone object, "" when there is nothing to add."""
        if self.gone:
            return "(deleted)"
        if self.name and self.owner:
            return f"{self.name} ({self.owner})"
        if self.owner:
            return f"unnamed ({self.owner})"
        return self.name


@dataclass(frozen=True, slots=True)
class _Named:
    name: str
    owner: str = ""


class AuditNames:
    """The names of the objects a page of events names: {object kind: {id as the event holds it: _Named}}."""

    def __init__(self, found: dict[str, dict[str, _Named]]):
        self._found = found

    def _ref(self, kind: str, object_kind: str | None, raw_id: str) -> Ref:
        if object_kind is None or not raw_id:
            return Ref(kind=kind, id=raw_id)
        named = self._found.get(object_kind, {}).get(_key(object_kind, raw_id))
        if named is None:
            return Ref(kind=kind, id=raw_id, gone=True)
        return Ref(kind=kind, id=raw_id, name=named.name, owner=named.owner)

    def actor(self, event: AuditEvent) -> Ref:
        return self._ref(event.actor_kind, ACTOR_KIND_OBJECT.get(event.actor_kind), event.actor_id)

    def tenant(self, event: AuditEvent) -> Ref | None:
        if event.tenant_id is None:
            return None
        return self._ref("tenant", "tenant", str(event.tenant_id))

    def target(self, event: AuditEvent) -> Ref:
        return self._ref(event.target_type, TARGET_TYPE_OBJECT.get(event.target_type), event.target_id)


def _key(object_kind: str, raw_id: str) -> str:
    """The lookup key of an id: UUIDs in one spelling (an event may hold any), other ids as they are."""
    if object_kind in ("tenant", "key", "cache", "node"):
        wanted = as_uuid(raw_id)
        return str(wanted) if wanted is not None else ""
    return raw_id


def _wanted(events: Iterable[AuditEvent]) -> dict[str, set[str]]:
    """{object kind: the ids the events name}, each id already a lookup key ("" dropped: it names no row)."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for event in events:
        actor_object = ACTOR_KIND_OBJECT.get(event.actor_kind)
        if actor_object and event.actor_id:
            wanted[actor_object].add(_key(actor_object, event.actor_id))
        if event.tenant_id is not None:
            wanted["tenant"].add(str(event.tenant_id))
        target_object = TARGET_TYPE_OBJECT.get(event.target_type)
        if target_object and event.target_id:
            wanted[target_object].add(_key(target_object, event.target_id))
    for ids in wanted.values():
        ids.discard("")
    return wanted


def _live(status: str) -> bool:
    return status != Tenant.Status.ERASED


def audit_names(events: Iterable[AuditEvent]) -> AuditNames:
    """The names of every object `events` name, in at most one query per kind of object (five in all)."""
    events = list(events)
    wanted = _wanted(events)
    found: dict[str, dict[str, _Named]] = {}
    if wanted["user"]:
        pks = [int(pk) for pk in wanted["user"] if pk.isdigit() and len(pk) < 19]
        users = get_user_model().objects.filter(pk__in=pks)
        found["user"] = {str(pk): _Named(name) for pk, name in users.values_list("pk", users.model.USERNAME_FIELD)}
    if wanted["key"] or wanted["key_public_id"]:
        found["key"], found["key_public_id"] = _keys(wanted["key"], wanted["key_public_id"])
    if wanted["node"]:
        nodes = node_list().filter(pk__in=wanted["node"]).values_list("pk", "name")
        found["node"] = {str(pk): _Named(name) for pk, name in nodes}
    if wanted["tenant"]:
        tenants = tenant_list().filter(pk__in=wanted["tenant"]).values_list("pk", "name", "status")
        found["tenant"] = {str(pk): _Named(name) for pk, name, status in tenants if _live(status)}
    if wanted["cache"]:
        caches = cache_list(tenant_id=None).filter(pk__in=wanted["cache"])
        rows = caches.values_list("pk", "name", "tenant__name", "tenant__status")
        found["cache"] = {str(pk): _Named(name, owner) for pk, name, owner, status in rows if _live(status)}
    return AuditNames(found)


def _keys(key_ids: set[str], public_ids: set[str]) -> tuple[dict[str, _Named], dict[str, _Named]]:
    """API keys by id (a target) and by public id (an actor), in one query; an erased tenant's keys are gone."""
    matching = Q(pk__in=[uuid.UUID(pk) for pk in key_ids]) | Q(public_id__in=public_ids)
    rows = ApiKey.objects.filter(matching).values_list("pk", "public_id", "name", "tenant__name", "tenant__status")
    by_id, by_public_id = {}, {}
    for pk, public_id, name, owner, status in rows:
        if _live(status):
            by_id[str(pk)] = by_public_id[public_id] = _Named(name, owner)
    return by_id, by_public_id
