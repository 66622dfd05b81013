"""The nodes pages: list (state filter, bad filter -> 400, polled table), detail (facts, tiers, hosted caches,
migrations with progress, polled only while one runs), and cordon / uncordon / drain through a confirmation step,
audited as the signed-in operator; read-only and compliance users are refused, a refused transition is a 409 page
that changes nothing."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.actions import AuditAction
from audit.models import AuditEvent
from caches.migration import migration_progress, migration_start
from caches.models import Migration
from fleet import services as fleet_services
from fleet.models import Node
from tests.console.conftest import csrf_token
from tests.console.nodes_fixtures import BLOCK, SPEC, attach, heartbeat, make_node, make_ready, make_tenant

pytestmark = pytest.mark.django_db


def _events(action: AuditAction) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=int(action)).order_by("seq"))


def _state(node: Node) -> str:
    node.refresh_from_db()
    return node.state


@pytest.fixture
def placed():
    """small (hosting acme's ready cache "kv", 3 blocks resident) and large (empty) ready nodes."""
    small, large = make_node("small", device=40 * BLOCK), make_node("large", device=80 * BLOCK)
    acme = make_tenant("acme")
    cache = make_ready(attach(acme, "kv"))
    assert cache.node_id == small.pk  # best fit
    heartbeat(small, [{"cache_id": str(cache.pk), "device_bytes": 3 * BLOCK}])
    return {"small": small, "large": large, "cache": cache, "tenant": acme}


# ---- list ---------------------------------------------------------------------------------------------------------


def test_list_shows_every_node_with_state_lease_tiers_and_caches(readonly_client, placed):
    make_node("fresh", register=False)
    page = readonly_client.get("/console/nodes/")
    assert page.status_code == 200
    rows = {row.node.name: row for row in page.context["rows"]}
    assert set(rows) == {"small", "large", "fresh"}
    assert rows["small"].hosted_caches == 1 and rows["large"].hosted_caches == 0
    assert rows["fresh"].lease_age_seconds is None and 0 <= rows["small"].lease_age_seconds < 5
    assert 30 <= rows["small"].lease_expires_in_seconds <= 40
    html = page.content.decode()
    assert '<span class="badge state-registering">registering</span>' in html and ">never<" in html.replace("\n", "")
    assert f'max="{40 * BLOCK}" value="{8 * BLOCK}"' in html  # small's device reserved meter
    assert f'href="/console/nodes/{placed["small"].pk}/"' in html
    assert 'hx-get="/console/nodes/live"' in html and 'hx-trigger="every 5s"' in html


def test_filter_by_state_and_the_poll_keeps_it(readonly_client, placed):
    fleet_services.node_cordon(node_id=placed["large"].pk)
    page = readonly_client.get("/console/nodes/?state=cordoned")
    assert [row.node.name for row in page.context["rows"]] == ["large"]
    assert 'hx-get="/console/nodes/live?state=cordoned"' in page.content.decode()
    live = readonly_client.get("/console/nodes/live?state=cordoned", HTTP_HX_REQUEST="true", HTTP_X_CONSOLE_POLL="1")
    html = live.content.decode()
    assert live.status_code == 200 and html.lstrip().startswith('<div id="nodes-table"') and "<html" not in html
    assert ">large</a>" in html and ">small</a>" not in html
    empty = readonly_client.get("/console/nodes/?state=draining")
    assert b"No node is draining." in empty.content


@pytest.mark.parametrize("query", ["state=bogus", "state=%00", "state=" + "x" * 5000])
def test_unknown_state_filter_is_a_400_with_the_form_error(readonly_client, placed, query):
    page = readonly_client.get(f"/console/nodes/?{query}")
    assert page.status_code == 400
    assert b"Select a valid choice" in page.content and b"the filter is not valid" in page.content
    assert page.context["rows"] == []


def test_bad_page_number_falls_back_to_a_page(readonly_client, placed):
    assert readonly_client.get("/console/nodes/?page=abc").status_code == 200
    assert readonly_client.get("/console/nodes/?page=99999999999999999999").status_code == 200


# ---- detail -------------------------------------------------------------------------------------------------------


def test_detail_shows_facts_tiers_and_hosted_caches(readonly_client, placed):
    small = placed["small"]
    page = readonly_client.get(f"/console/nodes/{small.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<span class="badge state-ready" id="node-state">ready</span>' in html
    assert f'max="{40 * BLOCK}" value="{3 * BLOCK}"' in html  # resident meter from the heartbeat snapshot
    [hosted] = page.context["hosted"]
    assert (hosted["cache"].tenant_name, hosted["cache"].name, hosted["cache"].state) == ("acme", "kv", "ready")
    assert hosted["cache"].resident_bytes == {"device": 3 * BLOCK, "dram": 0, "ssd": 0, "network": 0}
    assert hosted["tenant_url"].endswith(f"/console/tenants/{placed['tenant'].pk}/")
    assert b"No incoming migrations." in page.content and b"No outgoing migrations." in page.content
    assert 'id="node-live"' in html and 'hx-get="/console/nodes/' not in html  # nothing moving: no polling
    assert placed["cache"].hash_key_sealed not in page.content
    assert "Cordon</a>" not in html  # read-only: no actions offered


def test_detail_of_unknown_or_malformed_node_is_404(readonly_client, db):
    assert readonly_client.get(f"/console/nodes/{uuid.uuid4()}/").status_code == 404
    assert readonly_client.get("/console/nodes/not-a-uuid/").status_code == 404
    assert readonly_client.get(f"/console/nodes/{uuid.uuid4()}/live", HTTP_HX_REQUEST="true").status_code == 404


def test_running_migration_shows_progress_and_polls(operator_client, placed):
    small, large, cache = placed["small"], placed["large"], placed["cache"]
    migration = migration_start(cache_id=cache.pk, target_node_id=large.pk)
    migration_progress(migration_id=migration.pk, node_id=large.pk, phase="ready", info={})
    migration_progress(
        migration_id=migration.pk, node_id=small.pk, phase="copy", info={"blocks": 1, "bytes_sent": BLOCK}
    )
    html = operator_client.get(f"/console/nodes/{small.pk}/").content.decode()
    assert f'hx-get="/console/nodes/{small.pk}/live"' in html and 'hx-trigger="every 5s"' in html
    assert f'<progress max="{3 * BLOCK}" value="{BLOCK}"' in html  # of what the source reported resident
    assert '<span class="badge state-copying">copying</span>' in html and ">large</a>" in html
    live = operator_client.get(f"/console/nodes/{large.pk}/live", HTTP_HX_REQUEST="true")
    incoming = live.content.decode()
    assert live.status_code == 200 and incoming.lstrip().startswith('<div id="node-live"')
    assert ">small</a>" in incoming and "Incoming migrations" in incoming and "<html" not in incoming


# ---- actions ------------------------------------------------------------------------------------------------------


def test_cordon_confirmation_changes_nothing_then_post_cordons_and_audits(operator_client, placed):
    small = placed["small"]
    confirm = operator_client.get(f"/console/nodes/{small.pk}/cordon")
    assert confirm.status_code == 200 and b"Cordon node small?" in confirm.content
    assert f'action="/console/nodes/{small.pk}/cordon"'.encode() in confirm.content
    assert _state(small) == "ready" and not _events(AuditAction.NODE_CORDONED)
    answer = operator_client.post(f"/console/nodes/{small.pk}/cordon", follow=True)
    assert answer.redirect_chain == [(f"/console/nodes/{small.pk}/", 302)]
    assert b"Node small: ready -&gt; cordoned." in answer.content
    assert _state(small) == "cordoned"
    [event] = _events(AuditAction.NODE_CORDONED)
    assert (event.actor_kind, event.actor_id, event.target_id) == ("user", str(operator_client.user.pk), str(small.pk))
    assert (event.old_values, event.new_values) == ({"state": "ready"}, {"state": "cordoned"})


def test_uncordon_returns_the_node_to_ready_and_repeating_changes_nothing(operator_client, placed):
    small = placed["small"]
    fleet_services.node_cordon(node_id=small.pk)
    answer = operator_client.post(f"/console/nodes/{small.pk}/uncordon", follow=True)
    assert b"Node small: cordoned -&gt; ready." in answer.content and _state(small) == "ready"
    [event] = _events(AuditAction.NODE_UNCORDONED)
    assert event.actor_id == str(operator_client.user.pk)
    again = operator_client.post(f"/console/nodes/{small.pk}/uncordon", follow=True)
    assert b"Node small was already ready; nothing changed." in again.content
    assert len(_events(AuditAction.NODE_UNCORDONED)) == 1


def test_drain_confirmation_lists_the_caches_that_will_move(operator_client, placed):
    small, cache = placed["small"], placed["cache"]
    attach(placed["tenant"], "warming")  # provisioning on small: stays until it is ready
    confirm = operator_client.get(f"/console/nodes/{small.pk}/drain")
    assert confirm.status_code == 200
    assert b"Will move: acme / kv" in confirm.content
    assert b"Not moved (provisioning, not ready), stays: acme / warming" in confirm.content
    assert _state(small) == "ready" and not Migration.objects.exists() and not _events(AuditAction.NODE_DRAINING)
    cache.refresh_from_db()
    assert (cache.state, cache.node_id) == ("ready", small.pk)


def test_drain_starts_a_migration_for_the_ready_cache_and_audits(operator_client, placed):
    small, large, cache = placed["small"], placed["large"], placed["cache"]
    answer = operator_client.post(f"/console/nodes/{small.pk}/drain", follow=True)
    assert answer.status_code == 200
    assert b"Node small: ready -&gt; draining. 1 cache migration(s) started." in answer.content
    assert _state(small) == "draining"
    [migration] = Migration.objects.all()
    assert (migration.cache_id, migration.source_id, migration.target_id, migration.reason, migration.state) == (
        cache.pk,
        small.pk,
        large.pk,
        "drain",
        "pending",
    )
    [event] = _events(AuditAction.NODE_DRAINING)
    assert (event.actor_kind, event.actor_id) == ("user", str(operator_client.user.pk))
    assert 'hx-trigger="every 5s"' in answer.content.decode()  # the outgoing migration is active


def test_drain_of_an_empty_node(operator_client, placed):
    large = placed["large"]
    confirm = operator_client.get(f"/console/nodes/{large.pk}/drain")
    assert b"No ready cache is on this node." in confirm.content
    answer = operator_client.post(f"/console/nodes/{large.pk}/drain", follow=True)
    assert b"Node large: ready -&gt; draining. 0 cache migration(s) started." in answer.content
    assert _state(large) == "draining" and not Migration.objects.exists()


@pytest.mark.parametrize("action", ["cordon", "uncordon", "drain"])
@pytest.mark.parametrize("role_client", ["readonly_client", "compliance_client"])
def test_only_operators_may_act(request, placed, action, role_client):
    client = request.getfixturevalue(role_client)
    small = placed["small"]
    if action == "uncordon":
        fleet_services.node_cordon(node_id=small.pk)
    before, events = _state(small), AuditEvent.objects.count()
    assert client.get(f"/console/nodes/{small.pk}/{action}").status_code == 403
    refused = client.post(f"/console/nodes/{small.pk}/{action}")
    assert refused.status_code == 403 and b"Your console role does not allow this." in refused.content
    assert _state(small) == before and AuditEvent.objects.count() == events and not Migration.objects.exists()


@pytest.mark.parametrize(
    "action, message",
    [
        ("cordon", b"A lost node cannot be cordoned."),
        ("uncordon", b"A lost node cannot be uncordoned."),
        ("drain", b"A lost node cannot be drained."),
    ],
)
def test_refused_transition_is_a_409_page_and_changes_nothing(operator_client, placed, action, message):
    small = placed["small"]
    fleet_services.nodes_expire_leases(now=timezone.now() + timedelta(seconds=60))
    assert _state(small) == "lost"
    events = AuditEvent.objects.count()
    answer = operator_client.post(f"/console/nodes/{small.pk}/{action}")
    assert answer.status_code == 409 and message in answer.content and b"invalid_node_state" in answer.content
    assert _state(small) == "lost" and AuditEvent.objects.count() == events and not Migration.objects.exists()


def test_unknown_node_and_wrong_method(operator_client, db):
    missing = uuid.uuid4()
    assert operator_client.get(f"/console/nodes/{missing}/cordon").status_code == 404
    assert operator_client.post(f"/console/nodes/{missing}/drain").status_code == 404
    assert operator_client.post("/console/nodes/12345/cordon").status_code == 404
    assert operator_client.post("/console/nodes/").status_code == 405


def test_action_needs_the_csrf_token(console_client, placed):
    client = console_client("operator", csrf=True)
    small = placed["small"]
    assert client.post(f"/console/nodes/{small.pk}/cordon").status_code == 403
    assert _state(small) == "ready"
    client.get(f"/console/nodes/{small.pk}/cordon")
    answer = client.post(f"/console/nodes/{small.pk}/cordon", {"csrfmiddlewaretoken": csrf_token(client)})
    assert answer.status_code == 302 and _state(small) == "cordoned"


def test_operator_sees_the_actions_the_state_allows(operator_client, placed):
    small = placed["small"]
    html = operator_client.get(f"/console/nodes/{small.pk}/").content.decode()
    assert f'href="/console/nodes/{small.pk}/cordon"' in html and f'href="/console/nodes/{small.pk}/drain"' in html
    assert "/uncordon" not in html
    fleet_services.node_cordon(node_id=small.pk)
    html = operator_client.get(f"/console/nodes/{small.pk}/").content.decode()
    assert f'href="/console/nodes/{small.pk}/uncordon"' in html and '/cordon"' not in html.replace("/uncordon", "")


def test_agent_registry_counters_reach_the_overview_through_the_heartbeat(operator_client, placed):
    """End to end: the agent registry's resident snapshot (with the engine's hit/miss counters), sent as the
    heartbeat's `resident`, becomes the overview's hit rate."""
    from gpu_node.agent.registry import CacheRegistry
    from tests.gpu_node.kv_fixtures import prefix_kv

    registry = CacheRegistry(device_capacity_bytes=16 * BLOCK, device="cpu")
    cache_id = str(placed["cache"].pk)
    engine = registry.provision(
        cache_id=cache_id, spec=SPEC, capacity={"device": 8 * BLOCK}, hash_key=b"k" * 32, epoch=1
    ).engine
    tokens = list(range(32))
    engine.put(tokens, prefix_kv(SPEC, tokens))
    engine.get(tokens + list(range(100, 108)))  # 32 tokens cached, 8 not
    [entry] = registry.resident_snapshot()
    assert (entry["hit_tokens"], entry["miss_tokens"]) == (32, 8)
    heartbeat(placed["small"], registry.resident_snapshot())
    assert '<p class="stat" id="hit-rate">80.0%</p>' in operator_client.get("/console/").content.decode()


# ---- what a confirmation promises ------------------------------------------------------------------------------------


def _page(answer) -> str:
    """The page's text as a reader sees it (HTML-escaped quotes back)."""
    return answer.content.decode().replace("&#x27;", "'")


def test_drain_of_the_only_node_says_its_caches_stay_and_needs_the_name_typed(operator_client):
    solo = make_node("solo", device=40 * BLOCK)
    cache = make_ready(attach(make_tenant("acme"), "kv"))
    confirm = operator_client.get(f"/console/nodes/{solo.pk}/drain")
    page = _page(confirm)
    assert confirm.status_code == 200
    assert "Drain node solo? No other node can take its caches: it is the fleet's only node." in page
    assert (
        "Its 1 ready cache cannot be migrated. It stays on node solo, ready and serving their tenants, and nothing "
        "moves it later on its own (drain again once another node can take it)." in page
    )
    assert "every new cache is refused (no capacity) until a node is uncordoned or added" in page
    assert "Cannot move, stays on this node: acme / kv" in page
    assert "migrated to another node" not in page and "Will move" not in page
    assert 'id="id_confirm" name="confirm"' in page and "Type <strong>solo</strong> to confirm" in page
    for typed in ({}, {"confirm": "SOLO"}, {"confirm": "solo2"}):  # not confirmed: a 400, nothing changed
        refused = operator_client.post(f"/console/nodes/{solo.pk}/drain", typed)
        assert refused.status_code == 400 and "Type the node's name to confirm" in _page(refused)
        assert 'aria-invalid="true"' in _page(refused)
    assert _state(solo) == "ready" and not _events(AuditAction.NODE_DRAINING)
    answer = operator_client.post(f"/console/nodes/{solo.pk}/drain", {"confirm": " solo "}, follow=True)
    assert "Node solo: ready -&gt; draining. 0 cache migration(s) started." in _page(answer)
    assert "1 ready cache(s) did not start moving" in _page(answer)
    cache.refresh_from_db()
    assert _state(solo) == "draining" and (cache.state, cache.node_id) == ("ready", solo.pk)  # what the page said
    assert not Migration.objects.exists() and len(_events(AuditAction.NODE_DRAINING)) == 1


@pytest.mark.parametrize("other_state", ["cordoned", "draining", "lost"])
def test_drain_when_no_other_node_takes_caches(operator_client, placed, other_state):
    small, large = placed["small"], placed["large"]
    if other_state == "lost":
        Node.objects.filter(pk=large.pk).update(state="lost")
    else:
        (fleet_services.node_cordon if other_state == "cordoned" else fleet_services.node_drain)(node_id=large.pk)
    page = _page(operator_client.get(f"/console/nodes/{small.pk}/drain"))
    assert "No other node can take its caches: every other node is cordoned, draining, lost" in page
    assert "Its 1 ready cache cannot be migrated. It stays on node small" in page
    assert "Type <strong>small</strong> to confirm" in page
    assert operator_client.post(f"/console/nodes/{small.pk}/drain").status_code == 400
    assert _state(small) == "ready"


def test_drain_with_other_nodes_keeps_the_migration_wording_and_counts_them(operator_client, placed):
    small = placed["small"]
    make_node("spare", device=80 * BLOCK)
    fleet_services.node_cordon(node_id=make_node("fenced", device=80 * BLOCK).pk)  # takes no new caches
    page = _page(operator_client.get(f"/console/nodes/{small.pk}/drain"))
    assert (
        "Drain node small? It takes no new caches and each ready cache on it is migrated to another node: "
        "2 other nodes can take new caches now." in page
    )
    assert "Will move: acme / kv (2 other nodes with room for it now)" in page
    assert "cannot be migrated" not in page and 'name="confirm"' not in page  # one click, as before


def test_drain_says_which_ready_cache_no_other_node_has_room_for(operator_client):
    big, roomy = make_node("big", device=200 * BLOCK), make_node("roomy", device=80 * BLOCK)
    tenant = make_tenant("acme")
    huge = make_ready(attach(tenant, "huge", device=100 * BLOCK))  # fits only on big
    fleet_services.node_cordon(node_id=roomy.pk)
    small_one = make_ready(attach(tenant, "tiny", device=8 * BLOCK))
    fleet_services.node_uncordon(node_id=roomy.pk)
    assert huge.node_id == big.pk and small_one.node_id == big.pk  # roomy (80 blocks) has room for tiny only
    page = _page(operator_client.get(f"/console/nodes/{big.pk}/drain"))
    assert "1 other node can take new caches now." in page
    assert "1 of its 2 ready caches cannot be migrated: no other node has room for it. It stays on node big" in page
    assert "Cannot move, stays on this node: acme / huge" in page
    assert "Will move: acme / tiny (1 other node with room for it now)" in page
    assert "Type <strong>big</strong> to confirm" in page


def test_cordon_and_uncordon_state_their_consequences(operator_client, placed):
    small, large = placed["small"], placed["large"]
    page = _page(operator_client.get(f"/console/nodes/{small.pk}/cordon"))
    assert "It takes no new caches; the caches on it stay and keep serving." in page
    assert "every new cache is refused" not in page  # large still takes new caches
    fleet_services.node_cordon(node_id=large.pk)
    page = _page(operator_client.get(f"/console/nodes/{small.pk}/cordon"))
    assert "once node small is cordoned every new cache is refused (no capacity)" in page
    fleet_services.node_drain(node_id=small.pk)
    page = _page(operator_client.get(f"/console/nodes/{small.pk}/uncordon"))
    assert "Uncordon node small? It takes new caches again." in page
    assert "migrations of its caches already under way go on" in page
