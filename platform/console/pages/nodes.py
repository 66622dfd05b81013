"""Console pages: nodes — the list (filter by state, polled), a node's detail (tiers, hosted caches, migrations;
polled while a migration runs) and the operator's actions cordon, uncordon and drain.

Each action is GET (the confirmation page, which changes nothing and states what the action does to the node's
caches and to the fleet's placements) then POST, and calls exactly what the REST API calls: fleet.services.node_cordon
/ node_uncordon (POST /api/v1/admin/nodes/{id}/cordon, /uncordon) and caches.migration.node_drain_caches (POST
/api/v1/admin/nodes/{id}/drain). Those services lock the node, refuse a transition its state does not allow (409,
nothing changed) and write the audit event as the signed-in user. A drain that cannot migrate every ready cache (no
other node takes new caches, or none has room for one) says so and which caches stay, and needs the node's name
typed (`DrainPlan`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from caches.migration import node_drain_caches
from caches.models import ACTIVE_MIGRATION_STATES, NODE_TIERS, TIERS, CacheState
from caches.selectors import HostedCache, caches_hosted_on, hosted_cache_counts, migrations_of_node
from console.access import console_view, page_context
from console.pages.overview import tenant_url
from console.series import charts_context
from fleet import selectors as fleet_selectors
from fleet import services as fleet_services
from fleet.models import Node, NodeState

PAGE_SIZE = 50


class NodeFilterForm(forms.Form):
    state = forms.ChoiceField(choices=[("", "All states"), *NodeState.choices], required=False)


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A node with what the list shows beside its own fields."""

    node: Node
    lease_age_seconds: int | None  # since the last heartbeat (or registration); None: never heard from
    lease_expires_in_seconds: int | None  # negative once passed; None: no lease
    tiers: list
    hosted_caches: int


def _seconds_between(later, earlier) -> int | None:
    return None if later is None or earlier is None else int((later - earlier).total_seconds())


def node_row(node: Node, *, hosted: int, now) -> NodeRow:
    return NodeRow(
        node=node,
        lease_age_seconds=_seconds_between(now, node.last_heartbeat_at),
        lease_expires_in_seconds=_seconds_between(node.lease_expires_at, now),
        tiers=fleet_selectors.node_tier_use(node),
        hosted_caches=hosted,
    )


# ---- list -----------------------------------------------------------------------------------------------------------


def _list_context(request) -> tuple[dict, int]:
    """The list's context and status: 400 with the form's errors (and no rows) for an unknown state."""
    form = NodeFilterForm(request.GET)
    if not form.is_valid():
        return {"form": form, "rows": [], "invalid": True, "query": ""}, 400
    state = form.cleaned_data["state"] or None
    page = Paginator(fleet_selectors.node_list(state=state), PAGE_SIZE).get_page(request.GET.get("page"))
    counts = hosted_cache_counts(node_ids=[node.pk for node in page])
    now = timezone.now()
    rows = [node_row(node, hosted=counts.get(node.pk, 0), now=now) for node in page]
    query = urlencode({"state": state}) if state else ""
    poll_query = urlencode({k: v for k, v in (("state", state), ("page", page.number > 1 and page.number)) if v})
    return {"form": form, "rows": rows, "page": page, "query": query, "poll_query": poll_query, "state": state}, 200


def _list_page(request, template: str = "console/nodes/list.html"):
    context, status = _list_context(request)
    return render(request, template, page_context(request, title="Nodes", section="nodes", **context), status=status)


@console_view()
def index(request):
    return _list_page(request)


@console_view()
def index_live(request):
    """The table for an htmx poll; the whole list page for a plain request."""
    return _list_page(request, "console/nodes/_table.html" if request.htmx else "console/nodes/list.html")


# ---- detail ---------------------------------------------------------------------------------------------------------


def _expected_bytes(migration) -> int | None:
    """The bytes the source last reported resident for the moving cache: the 100% of a running copy's bar."""
    entry = ((migration.source.resident_snapshot or {}).get("caches") or {}).get(str(migration.cache_id)) or {}
    total = sum(int(entry.get(tier, 0) or 0) for tier in TIERS)
    return total or None


def _migration_rows(migrations) -> list[dict]:
    return [
        {
            "migration": m,
            "active": m.state in ACTIVE_MIGRATION_STATES,
            "expected_bytes": _expected_bytes(m),
            "tenant_url": tenant_url(m.cache.tenant_id),
        }
        for m in migrations
    ]


def _detail_context(node_id: uuid.UUID) -> dict:
    node = fleet_selectors.node_get(node_id=node_id)  # 404 not_found
    hosted = caches_hosted_on(node=node)
    moves = migrations_of_node(node_id=node.pk)
    incoming, outgoing = _migration_rows(moves["incoming"]), _migration_rows(moves["outgoing"])
    return {
        "node": node,
        "row": node_row(node, hosted=len(hosted), now=timezone.now()),
        "hosted": [{"cache": c, "tenant_url": tenant_url(c.tenant_id)} for c in hosted],
        "incoming": incoming,
        "outgoing": outgoing,
        "migrating": any(row["active"] for row in incoming + outgoing),
        "network_resident": sum(c.resident_bytes.get("network", 0) for c in hosted),
        "network_granted": sum(c.capacity_bytes.get("network", 0) for c in hosted),
        "reported_at": parse_datetime(str((node.resident_snapshot or {}).get("reported_at") or "")),
    }


def _detail_page(request, node_id: uuid.UUID, template: str = "console/nodes/detail.html"):
    context = _detail_context(node_id)
    if template == "console/nodes/detail.html":  # the whole page: its charts too (not polled)
        context.update(charts_context(node_id=node_id), scope=f"node {context['node'].name}")
    return render(
        request, template, page_context(request, title=f"Node {context['node'].name}", section="nodes", **context)
    )


@console_view()
def detail(request, node_id: uuid.UUID):
    return _detail_page(request, node_id)


@console_view()
def detail_live(request, node_id: uuid.UUID):
    """The detail's live part for an htmx poll; the whole page for a plain request."""
    return _detail_page(
        request, node_id, "console/nodes/_detail_live.html" if request.htmx else "console/nodes/detail.html"
    )


# ---- actions --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeAction:
    name: str  # the URL name's suffix and the verb in messages
    button: str
    danger: bool


CORDON = NodeAction("cordon", "Cordon", False)
UNCORDON = NodeAction("uncordon", "Uncordon", False)
DRAIN = NodeAction("drain", "Drain", True)
DRAINABLE = (NodeState.READY, NodeState.CORDONED)  # fleet.services.node_drain refuses the other states (409)
NOT_TAKING = "cordoned, draining, lost, still registering or past its lease"


def _placement_targets(node: Node) -> list[Node]:
    """The other nodes placement may choose now (fleet.services.node_place: ready with a live lease); where a drain
    of `node` can move its caches, and what keeps taking new caches once `node` does not."""
    live = fleet_selectors.node_list(state=NodeState.READY).filter(lease_expires_at__gt=timezone.now())
    return list(live.exclude(pk=node.pk))


def _fits(target: Node, capacity: dict[str, int]) -> bool:
    free = target.free
    return all(free.get(tier, 0) >= wanted for tier, wanted in capacity.items() if tier in free and wanted > 0)


@dataclass(frozen=True, slots=True)
class DrainPlan:
    """What a drain of a node does now, as caches.migration.node_drain_caches does it: the node takes no new caches,
    and each ready cache on it is migrated to where placement puts it; a ready cache that no other node has room for
    is not migrated (node_place refuses it) and stays on the node, ready and serving, with nothing retrying it (a
    later drain tries again); caches not ready are not moved. `fits` counts the targets with room for each cache
    alone: caches moved together may not all fit, and the outcome is reported after the drain."""

    node: Node
    targets: int  # other nodes that take new caches now
    moving: list[tuple[HostedCache, int]]  # (a ready cache, how many targets have room for it now)
    stuck: list[HostedCache]  # ready caches no target has room for: they stay
    staying: list[HostedCache]  # caches that are not ready: the drain does not move them

    @property
    def needs_typed_confirmation(self) -> bool:
        """A drain that cannot move every ready cache (or leaves no node taking new caches) is confirmed by typing
        the node's name."""
        return self.targets == 0 or bool(self.stuck)


def drain_plan(node: Node) -> DrainPlan:
    targets = _placement_targets(node)
    hosted = caches_hosted_on(node=node)
    moving, stuck = [], []
    for cache in hosted:
        if cache.state != CacheState.READY:
            continue
        room = sum(_fits(target, {t: cache.capacity_bytes.get(t, 0) for t in NODE_TIERS}) for target in targets)
        if room:
            moving.append((cache, room))
        else:
            stuck.append(cache)
    staying = [c for c in hosted if c.state != CacheState.READY]
    return DrainPlan(node=node, targets=len(targets), moving=moving, stuck=stuck, staying=staying)


def _nodes(count: int) -> str:
    return f"{count} other node" + ("" if count == 1 else "s")


def _stay(count: int, name: str) -> str:
    """What becomes of `count` ready caches a drain of node `name` cannot migrate (node_drain_caches leaves them)."""
    they, stay = ("It", "stays") if count == 1 else ("They", "stay")
    return (
        f"{they} {stay} on node {name}, ready and serving their tenants, and nothing moves "
        f"{'it' if count == 1 else 'them'} later on its own (drain again once another node can take "
        f"{'it' if count == 1 else 'them'})."
    )


def _drain_text(plan: DrainPlan) -> tuple[str, str, list[str]]:
    """(question, warning, details) of a drain's confirmation: what happens to every cache and to placement."""
    name, ready = plan.node.name, len(plan.moving) + len(plan.stuck)
    details = [f"Current state: {plan.node.state}."]
    details += [f"Will move: {c.tenant_name} / {c.name} ({_nodes(n)} with room for it now)" for c, n in plan.moving]
    details += [f"Cannot move, stays on this node: {c.tenant_name} / {c.name}" for c in plan.stuck]
    if not ready:
        details.append("No ready cache is on this node.")
    details += [f"Not moved ({c.state}, not ready), stays: {c.tenant_name} / {c.name}" for c in plan.staying]
    if plan.targets == 0:
        alone = not fleet_selectors.node_list().exclude(pk=plan.node.pk).exists()
        why = "it is the fleet's only node" if alone else f"every other node is {NOT_TAKING}"
        question = f"Drain node {name}? No other node can take its caches: {why}."
        lost = f"Its {ready} ready cache{'' if ready == 1 else 's'} cannot be migrated. {_stay(ready, name)} "
        warning = (lost if ready else "") + (
            f"Node {name} takes no new caches, and no other node does: every new cache is refused (no capacity) "
            "until a node is uncordoned or added."
        )
        return question, warning, details
    question = (
        f"Drain node {name}? It takes no new caches and each ready cache on it is migrated to another node: "
        f"{_nodes(plan.targets)} can take new caches now."
    )
    warning = ""
    if plan.stuck:
        stuck = len(plan.stuck)
        which = (
            f"{stuck} of its {ready} ready caches" if stuck < ready else f"Its ready cache{'' if stuck == 1 else 's'}"
        )
        warning = f"{which} cannot be migrated: no other node has room for {'it' if stuck == 1 else 'them'}. " + _stay(
            stuck, name
        )
    return question, warning, details


def _confirm(request, node: Node, action: NodeAction, question: str, details: list[str], *, status: int = 200, **extra):
    context = page_context(
        request,
        section="nodes",
        title=f"{action.button} node {node.name}",
        question=question,
        details=details,
        button=action.button,
        danger=action.danger,
        action_url=reverse(f"console:node_{action.name}", args=[node.pk]),
        cancel_url=reverse("console:node", args=[node.pk]),
        **extra,
    )
    return render(request, "console/confirm.html", context, status=status)


def _done(request, node: Node, old_state: str, extra: str = ""):
    if old_state == node.state:
        messages.info(request, f"Node {node.name} was already {node.state}; nothing changed.{extra}")
    else:
        messages.success(request, f"Node {node.name}: {old_state} -> {node.state}.{extra}")
    return redirect("console:node", node_id=node.pk)


def _cordon_question(node: Node) -> tuple[str, str]:
    question = f"Cordon node {node.name}? It takes no new caches; the caches on it stay and keep serving."
    if node.state == NodeState.READY and not _placement_targets(node):
        return question, (
            f"No other node takes new caches (each is {NOT_TAKING}): once node {node.name} is cordoned every new "
            "cache is refused (no capacity) until a node is uncordoned or added."
        )
    return question, ""


def _uncordon_question(node: Node) -> tuple[str, str]:
    question = f"Uncordon node {node.name}? It takes new caches again."
    if node.state == NodeState.DRAINING:
        return question, (
            "This stops nothing the drain started: migrations of its caches already under way go on and move those "
            "caches away; caches not moved stay here."
        )
    return question, ""


def _state_change(request, node_id: uuid.UUID, action: NodeAction, service, question):
    node = fleet_selectors.node_get(node_id=node_id)  # 404 not_found
    if request.method == "GET":
        text, warning = question(node)
        return _confirm(request, node, action, text, [f"Current state: {node.state}."], warning=warning)
    return _done(request, service(node_id=node.pk), node.state)  # a refusal raises: 409 page, nothing changed


@console_view("nodes.edit", methods=("GET", "POST"))
def cordon(request, node_id: uuid.UUID):
    return _state_change(request, node_id, CORDON, fleet_services.node_cordon, _cordon_question)


@console_view("nodes.edit", methods=("GET", "POST"))
def uncordon(request, node_id: uuid.UUID):
    return _state_change(request, node_id, UNCORDON, fleet_services.node_uncordon, _uncordon_question)


def _drain_confirm(request, plan: DrainPlan, *, error: str = "", status: int = 200):
    question, warning, details = _drain_text(plan)
    typed = plan.needs_typed_confirmation and plan.node.state in DRAINABLE
    return _confirm(
        request,
        plan.node,
        DRAIN,
        question,
        details,
        warning=warning,
        confirm_text=plan.node.name if typed else "",
        confirm_error=error,
        status=status,
    )


@console_view("nodes.edit", methods=("GET", "POST"))
def drain(request, node_id: uuid.UUID):
    """GET: the confirmation, with what happens to each cache; POST: caches.migration.node_drain_caches. A drain that
    cannot move every ready cache (or leaves no node taking new caches) also needs the node's name typed; the plan is
    computed again on POST, so a fleet that changed since the GET is confirmed as it is now."""
    node = fleet_selectors.node_get(node_id=node_id)  # 404 not_found
    plan = drain_plan(node)
    if request.method == "GET":
        return _drain_confirm(request, plan)
    typed = request.POST.get("confirm", "").strip()
    if plan.needs_typed_confirmation and node.state in DRAINABLE and typed != node.name:
        error = "Type the node's name to confirm: its caches cannot all be migrated. Nothing changed."
        return _drain_confirm(request, plan, error=error, status=400)
    old_state = node.state
    started = node_drain_caches(node_id=node.pk)  # a refusal raises: 409 page, nothing changed
    node.refresh_from_db()
    ready_left = len([c for c in caches_hosted_on(node=node) if c.state == CacheState.READY]) - len(started)
    extra = f" {len(started)} cache migration(s) started."
    if ready_left > 0:
        extra += (
            f" {ready_left} ready cache(s) did not start moving (no room elsewhere, or already moving): they stay here."
        )
    return _done(request, node, old_state, extra)


urlpatterns = [
    path("", index, name="nodes"),
    path("live", index_live, name="nodes_live"),
    path("<uuid:node_id>/", detail, name="node"),
    path("<uuid:node_id>/live", detail_live, name="node_live"),
    path("<uuid:node_id>/cordon", cordon, name="node_cordon"),
    path("<uuid:node_id>/uncordon", uncordon, name="node_uncordon"),
    path("<uuid:node_id>/drain", drain, name="node_drain"),
]
