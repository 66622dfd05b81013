"""In Debian's chromium: the audit table as people read it — at 1280x800 a screenful of events, one line each, with
names beside shortened ids and the whole ids one click away; at phone width one card per event with the names
visible and no sideways scrolling — and the drain confirmation of a fleet's only node, which says its caches stay
and needs the node's name typed."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction

from audit.actions import AuditAction
from audit.context import Actor, acting_as
from audit.services import audit_record
from console import roles
from tenants import services as tenant_services
from tests.console.browser.conftest import LAPTOP, accessibility_problems
from tests.console.nodes_fixtures import attach, make_node, make_ready, make_tenant

pytestmark = pytest.mark.django_db(transaction=True)
PHONE_390 = {"width": 390, "height": 844}


def _event(actor: Actor, target_type: str, target_id, tenant_id=None, action=AuditAction.QUOTA_UPDATED):
    with transaction.atomic(), acting_as(actor):
        audit_record(action=action, target_type=target_type, target_id=target_id, tenant_id=tenant_id, new={"n": 1})


def _seed_trail() -> dict:
    """Sixty-odd events naming a console user, API keys, nodes, caches and tenants with long names."""
    user = get_user_model().objects.create_user("oncall-operator-with-a-long-name")
    tenant = make_tenant("acme-industries-" + "x" * 40)
    key = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read"], name="ci-deployer-key").api_key
    node = make_node("gpu-node-eu-west-1a-017")
    cache = attach(tenant, "llama-3-70b-prefixes")
    for _ in range(15):
        _event(Actor("user", str(user.pk)), "tenant", tenant.pk, tenant.pk)
        _event(Actor("key", key.public_id), "api_key", key.pk, tenant.pk, AuditAction.KEY_REVOKED)
        _event(Actor("node", str(node.pk)), "cache", cache.pk, tenant.pk, AuditAction.CACHE_ATTACHED)
        _event(Actor("system"), "node", node.pk, None, AuditAction.NODE_LOST)
    return {"user": user, "tenant": tenant, "key": key, "node": node, "cache": cache}


_ROWS_JS = """() => {
  const rows = [...document.querySelectorAll('table.audit tbody tr')];
  const td = rows[0].querySelector('td');
  const style = getComputedStyle(td);
  const line = parseFloat(style.lineHeight);
  const padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
  return {
    line: line,
    heights: rows.map(r => r.getBoundingClientRect().height - padding),
    onScreen: rows.filter(r => r.getBoundingClientRect().bottom <= window.innerHeight).length,
    wrap: document.querySelector('table.audit').closest('.table-wrap').scrollWidth
      - document.querySelector('table.audit').closest('.table-wrap').clientWidth,
    page: document.documentElement.scrollWidth - window.innerWidth,
  };
}"""


def test_a_screenful_of_one_line_events_at_1280_with_names_beside_ids(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    seeded = _seed_trail()
    page.set_viewport_size(LAPTOP)
    page.goto(page.base + "/console/audit/")
    measured = page.evaluate(_ROWS_JS)
    assert measured["onScreen"] >= 12, measured  # the first screen holds at least twelve whole events
    assert max(measured["heights"]) < 2 * measured["line"], measured  # one line each: nothing wraps char by char
    assert measured["wrap"] <= 0 and measured["page"] <= 0, measured  # no sideways scrolling
    first = page.locator("table.audit tbody tr").first
    assert first.locator('td[data-label="Actor"]').inner_text() == "system"
    key_row = page.locator("table.audit tbody tr", has_text="key.revoked").first
    assert "ci-deployer-key (acme-industries-" in key_row.locator('td[data-label="Actor"]').inner_text()
    assert "oncall-operator-with-a-long-name" in page.locator('td[data-label="Actor"]').all_inner_texts()[3]
    time = first.locator('td[data-label="Time (UTC)"] time')
    assert len(time.inner_text()) == len("12-06 23:44:27") and time.get_attribute("datetime").startswith("20")
    node_id = str(seeded["node"].pk)
    assert first.locator('td[data-label="Target"] a').get_attribute("title").endswith(f"node:{node_id}")
    first.get_by_text("Values").click()  # the whole ids and values, below the row
    panel = first.locator("details.event-more dl")
    assert panel.is_visible() and f"node:{node_id}" in panel.inner_text()
    assert accessibility_problems(page) == []
    assert not page.js_errors


def test_one_card_per_event_at_390_px_with_names_and_no_sideways_scroll(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    _seed_trail()
    page.set_viewport_size(PHONE_390)
    page.goto(page.base + "/console/audit/")
    measured = page.evaluate(_ROWS_JS)
    assert measured["page"] <= 0, measured
    row = page.locator("table.audit tbody tr", has_text="key.revoked").first
    assert row.evaluate("r => getComputedStyle(r).display") == "block"  # a card, not a table row
    name = row.locator('td[data-label="Actor"] .ref-name')
    box = name.bounding_box()
    assert name.is_visible() and box["x"] >= 0 and box["x"] + box["width"] <= PHONE_390["width"], box
    assert name.inner_text().startswith("ci-deployer-key (acme-industries-")
    for cell in row.locator("td").all():
        cell_box = cell.bounding_box()
        if cell_box:  # hidden cells have none
            assert cell_box["x"] + cell_box["width"] <= PHONE_390["width"] + 0.5, cell_box
    assert accessibility_problems(page) == []
    first = page.locator("table.audit tbody tr").first.bounding_box()
    assert first["y"] < PHONE_390["height"], first  # the filters fold away: the first event is on the first screen
    page.get_by_text("Filters", exact=True).click()
    assert page.get_by_label("Action").is_visible()
    page.goto(page.base + "/console/audit/?action=key.revoked")  # filters set: they stay open
    assert page.get_by_label("Action").is_visible() and page.get_by_text("Filters (active)").is_visible()


def test_filters_stay_in_the_url_across_pages(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    _seed_trail()
    page.goto(page.base + "/console/audit/?action=node.lost")
    page.get_by_label("Actor (kind or kind:id)").fill("system")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**actor=system**")
    assert "action=node.lost" in page.url
    assert page.get_by_label("Action").input_value() == "node.lost"
    assert page.get_by_label("Actor (kind or kind:id)").input_value() == "system"
    assert "15 in all" in page.locator("table.audit caption").inner_text()


def test_the_drain_of_the_only_node_says_its_caches_stay_and_asks_for_its_name(signed_in):
    page, _ = signed_in(roles.OPERATOR)
    solo = make_node("solo-node", device=1 << 30)
    cache = make_ready(attach(make_tenant("acme"), "kv"))
    page.goto(page.base + f"/console/nodes/{solo.pk}/")
    page.get_by_role("link", name="Drain").click()
    page.wait_for_url(f"**/console/nodes/{solo.pk}/drain")
    text = page.locator("main").inner_text()
    assert "No other node can take its caches: it is the fleet's only node." in text
    assert "Its 1 ready cache cannot be migrated. It stays on node solo-node, ready and serving" in text
    assert "migrated to another node" not in text
    page.get_by_role("button", name="Drain").click()  # nothing typed: the browser keeps the form
    assert page.url.endswith(f"/console/nodes/{solo.pk}/drain")
    page.get_by_label("Type solo-node to confirm").fill("solo")
    page.get_by_role("button", name="Drain").click()
    assert "Type the node's name to confirm" in page.locator("#id_confirm_error").inner_text()
    solo.refresh_from_db()
    assert solo.state == "ready"
    page.get_by_label("Type solo-node to confirm").fill("solo-node")
    page.get_by_role("button", name="Drain").click()
    page.wait_for_url(f"**/console/nodes/{solo.pk}/")
    assert "Node solo-node: ready -> draining. 0 cache migration(s) started." in page.locator("main").inner_text()
    cache.refresh_from_db()
    assert (cache.state, cache.node_id) == ("ready", solo.pk)
    assert not page.js_errors
