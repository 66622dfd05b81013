"""Console pages: nodes — the list (filter by state, polled), a node's detail (tiers, hosted caches, migrations;
polled while a migration runs) and the operator's actions cordon, uncordon and drain.

Each action is GET (the confirmation page, which changes nothing) then POST, and calls exactly what the REST API
calls: fleet.services.node_cordon / node_uncordon (POST /api/v1/admin/nodes/{id}/cordon, /uncordon) and
caches.migration.node_drain_caches (POST /api/v1/admin/nodes/{id}/drain). Those services lock the node, refuse a
transition its state does not allow (409, nothing changed) and write the audit event as the signed-in user.
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
from caches.models import ACTIVE_MIGRATION_STATES, TIERS, CacheState
from caches.selectors import caches_hosted_on, hosted_cache_counts, migrations_of_node
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
    question: str
    danger: bool


CORDON = NodeAction("cordon", "Cordon", "Cordon node {name}? It takes no new caches; the caches on it stay.", False)
UNCORDON = NodeAction("uncordon", "Uncordon", "Uncordon node {name}? It takes new caches again.", False)
DRAIN = NodeAction(
    "drain",
    "Drain",
    "Drain node {name}? It takes no new caches and every ready cache on it is migrated to another node.",
    True,
)


def _confirm(request, node: Node, action: NodeAction, details: list[str]):
    context = page_context(
        request,
        section="nodes",
        title=f"{action.button} node {node.name}",
        question=action.question.format(name=node.name),
        details=details,
        button=action.button,
        danger=action.danger,
        action_url=reverse(f"console:node_{action.name}", args=[node.pk]),
        cancel_url=reverse("console:node", args=[node.pk]),
    )
    return render(request, "console/confirm.html", context)


def _done(request, node: Node, old_state: str, extra: str = ""):
    if old_state == node.state:
        messages.info(request, f"Node {node.name} was already {node.state}; nothing changed.{extra}")
    else:
        messages.success(request, f"Node {node.name}: {old_state} -> {node.state}.{extra}")
    return redirect("console:node", node_id=node.pk)


def _state_change(request, node_id: uuid.UUID, action: NodeAction, service):
    node = fleet_selectors.node_get(node_id=node_id)  # 404 not_found
    if request.method == "GET":
        return _confirm(request, node, action, [f"Current state: {node.state}."])
    return _done(request, service(node_id=node.pk), node.state)  # a refusal raises: 409 page, nothing changed


@console_view("nodes.edit", methods=("GET", "POST"))
def cordon(request, node_id: uuid.UUID):
    return _state_change(request, node_id, CORDON, fleet_services.node_cordon)


@console_view("nodes.edit", methods=("GET", "POST"))
def uncordon(request, node_id: uuid.UUID):
    return _state_change(request, node_id, UNCORDON, fleet_services.node_uncordon)


def _drain_details(node: Node) -> list[str]:
    hosted = caches_hosted_on(node=node)
    moving = [c for c in hosted if c.state == CacheState.READY]
    lines = [f"Current state: {node.state}."]
    lines += [f"Will move: {c.tenant_name} / {c.name}" for c in moving] or ["No ready cache is on this node."]
    lines += [f"Stays for now ({c.state}): {c.tenant_name} / {c.name}" for c in hosted if c not in moving]
    return lines


@console_view("nodes.edit", methods=("GET", "POST"))
def drain(request, node_id: uuid.UUID):
    node = fleet_selectors.node_get(node_id=node_id)  # 404 not_found
    if request.method == "GET":
        return _confirm(request, node, DRAIN, _drain_details(node))
    old_state = node.state
    started = node_drain_caches(node_id=node.pk)  # a refusal raises: 409 page, nothing changed
    node.refresh_from_db()
    ready_left = len([c for c in caches_hosted_on(node=node) if c.state == CacheState.READY]) - len(started)
    extra = f" {len(started)} cache migration(s) started."
    if ready_left > 0:
        extra += f" {ready_left} ready cache(s) did not start moving (no room elsewhere, or already moving)."
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
