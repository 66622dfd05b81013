"""Console audit pages: the events list (filters, paging that keeps them, 400s for bad filters, newest first), the
export (the REST export's records, digests, key and AUDIT_EXPORTED event, compliance only) and the verifier of
uploaded exports (OK, tampering named by seq, another key, malformed or oversize uploads: never a 500)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from audit import chain
from audit.actions import AuditAction
from audit.context import Actor, acting_as
from audit.digests import audit_digest_sign
from audit.keys import b64url, platform_public_jwk, public_jwk_of
from audit.models import AuditEvent
from audit.services import audit_record
from console import roles
from tenants import services as tenant_services
from tenants.models import ApiKey, Tenant
from tests.audit.events_support import staff  # noqa: F401  (fixture)
from tests.audit.helpers import next_second, record
from tests.console.conftest import csrf_token
from tests.console.nodes_fixtures import attach, make_node

pytestmark = pytest.mark.django_db
EVENTS, EXPORT, VERIFY = "/console/audit/", "/console/audit/export", "/console/audit/verify"
ROW_SEQ = re.compile(r'<tr>\s*<td class="num"[^>]*>(\d+)</td>')


@pytest.fixture
def tenants():
    return Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")


@pytest.fixture
def trail(tenants):
    """Four events: two of acme (key:k1, key:k2), one of globex (node:n1), one without a tenant (system)."""
    acme, globex = tenants
    return [
        record(acme.pk, actor=Actor("key", "k1"), new={"max_caches": 3}),
        record(acme.pk, action=AuditAction.KEY_REVOKED, actor=Actor("key", "k2"), new={"revoked": True}),
        record(globex.pk, action=AuditAction.CACHE_ATTACHED, actor=Actor("node", "n1")),
        record(None, action=AuditAction.NODE_LOST, actor=Actor("system", "")),
    ]


def seqs(response) -> list[int]:
    assert response.status_code == 200, response.content[:2000]
    return [int(seq) for seq in ROW_SEQ.findall(response.content.decode())]


def text(response) -> str:
    return response.content.decode()


def iso(moment: datetime) -> str:
    """A time as a naive UTC ISO string with microseconds (what the page reads as UTC)."""
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat()


def downloaded(response) -> str:
    assert response.status_code == 200, getattr(response, "content", b"")[:2000]
    return b"".join(response.streaming_content).decode()


def exported_events() -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=AuditAction.AUDIT_EXPORTED).order_by("seq"))


# ---- events ----------------------------------------------------------------------------------------------------------


def test_events_are_listed_newest_first_with_every_column(readonly_client, trail):
    page = readonly_client.get(EVENTS)
    assert seqs(page) == sorted(AuditEvent.objects.values_list("seq", flat=True), reverse=True)
    body = text(page)
    assert "newest first" in body and "UTC" in body and page["Cache-Control"] == "no-store"
    assert "key.revoked" in body and "key:k2" in body and "acme" in body and "globex" in body
    assert f'href="?tenant={trail[0].tenant_id}"' in body
    assert '<details class="event-more">' in body and "&quot;revoked&quot;: true" in body  # values, in a disclosure
    at = trail[0].occurred_at.astimezone(UTC)
    assert f'<time datetime="{at.isoformat()}" title="{at.isoformat()}">{at:%m-%d %H:%M:%S}</time>' in body
    assert 'type="datetime-local"' in body and '<select name="action"' in body


@pytest.mark.parametrize(
    "make_query, expected",
    [
        (lambda t, e: {"tenant": str(t[0].pk)}, [1, 0]),
        (lambda t, e: {"tenant": "acme"}, [1, 0]),
        (lambda t, e: {"tenant": "  globex "}, [2]),
        (lambda t, e: {"actor": "key:k2"}, [1]),
        (lambda t, e: {"actor": "node"}, [2]),
        (lambda t, e: {"action": AuditAction.NODE_LOST.code_name}, [3]),
        (lambda t, e: {"action": "key.revoked"}, [1]),  # the name the table shows
        (lambda t, e: {"from": iso(e[1].occurred_at), "to": iso(e[3].occurred_at)}, [2, 1]),  # [from, to)
        (lambda t, e: {"from": iso(e[1].occurred_at), "tenant": "acme", "actor": "key"}, [1]),
        (lambda t, e: {"tenant": "acme", "action": AuditAction.NODE_LOST.code_name}, []),
    ],
)
def test_each_filter_and_their_combinations(readonly_client, tenants, trail, make_query, expected):
    page = readonly_client.get(EVENTS, make_query(tenants, trail))
    assert seqs(page) == [trail[i].seq for i in expected]
    if not expected:
        assert "No audit events match these filters." in text(page)


def test_times_are_read_and_shown_as_utc_whatever_the_server_zone(readonly_client, trail, settings):
    settings.TIME_ZONE = "America/New_York"
    page = readonly_client.get(EVENTS, {"from": iso(trail[2].occurred_at)})
    assert seqs(page)[-2:] == [trail[3].seq, trail[2].seq]
    assert trail[0].seq not in seqs(page)
    at = trail[2].occurred_at.astimezone(UTC)
    assert f'datetime="{at.isoformat()}"' in text(page) and f">{at:%m-%d %H:%M:%S}</time>" in text(page)
    assert seqs(readonly_client.get(EVENTS, {"to": "2000-01-01T00:00"})) == []  # the browser's minute precision


def test_paging_keeps_the_filters(readonly_client, tenants):
    acme, _ = tenants
    mine = [record(acme.pk, actor=Actor("key", "pager"), new={"n": n}).seq for n in range(57)]
    record(acme.pk, actor=Actor("key", "other"))
    query = {"tenant": "acme", "actor": "key:pager"}
    first = readonly_client.get(EVENTS, query)
    assert seqs(first) == mine[::-1][:50]
    next_link = re.search(r'href="\?([^"]+)" rel="next"', text(first)).group(1).replace("&amp;", "&")
    assert next_link == "tenant=acme&actor=key%3Apager&page=2"
    second = readonly_client.get(EVENTS + "?" + next_link)
    assert seqs(second) == mine[::-1][50:] and "Page 2 of 2 (57 in all)" in text(second)
    assert 'rel="prev"' in text(second) and 'href="?tenant=acme&amp;actor=key%3Apager&amp;page=1"' in text(second)
    assert seqs(readonly_client.get(EVENTS, {**query, "page": "junk"})) == mine[::-1][:50]


@pytest.mark.parametrize(
    "query, message",
    [
        ({"from": "yesterday"}, "Enter a valid date/time."),
        ({"to": "2026-13-45T99:00"}, "Enter a valid date/time."),
        ({"from": "2030-01-01T00:00", "to": "2029-01-01T00:00"}, "“To” must be after “From”."),
        ({"from": "2030-01-01T00:00", "to": "2030-01-01T00:00"}, "“To” must be after “From”."),
        ({"tenant": "not-a-uuid"}, "No such tenant"),
        ({"tenant": "x" * 101}, "at most 100 characters"),
        ({"actor": "robot:1"}, "An actor is `kind` or `kind:id`"),
        ({"actor": "user:"}, "An actor is `kind` or `kind:id`"),
        ({"action": str(int(AuditAction.NODE_LOST))}, "Choose an action from the list"),  # codes are not names
        ({"action": "key.exploded"}, "Choose an action from the list"),
    ],
)
def test_bad_filters_are_a_400_with_the_form_errors(readonly_client, trail, query, message):
    page = readonly_client.get(EVENTS, query)
    assert page.status_code == 400
    body = text(page)
    assert "The filters are not valid" in body and message in body
    assert ROW_SEQ.findall(body) == []  # no rows under a refused filter
    field = list(query)[-1]  # the field the error belongs to
    assert f'aria-invalid="true" aria-describedby="id_{field}_error"' in body and f'id="id_{field}_error"' in body


def test_filters_live_in_the_url_prefill_the_form_and_survive_paging_and_row_links(readonly_client, tenants):
    acme, _ = tenants
    mine = [record(acme.pk, actor=Actor("key", "pager"), new={"n": n}).seq for n in range(53)]
    record(acme.pk, actor=Actor("key", "pager"), action=AuditAction.KEY_REVOKED)  # another action
    query = {
        "from": "2000-01-01T00:00:00",
        "to": "2999-01-01T00:00:00",
        "tenant": "acme",
        "actor": "key:pager",
        "action": "quota.updated",
        "target": f"tenant:{acme.pk}",
    }
    first = readonly_client.get(EVENTS, query)
    assert seqs(first) == mine[::-1][:50]
    body = text(first)
    for name, value in query.items():  # the form shows the filters the URL holds
        if name != "action":
            assert f'name="{name}" value="{value}"' in body, name
    assert '<option value="quota.updated" selected>quota.updated</option>' in body
    kept = "from=2000-01-01T00%3A00%3A00&to=2999-01-01T00%3A00%3A00&tenant=acme&actor=key%3Apager&action=quota.updated"
    kept += f"&target=tenant%3A{acme.pk}"
    next_link = re.search(r'href="\?([^"]+)" rel="next"', body).group(1).replace("&amp;", "&")
    assert next_link == kept + "&page=2"
    second = readonly_client.get(EVENTS + "?" + next_link)
    assert seqs(second) == mine[::-1][50:] and "Page 2 of 2 (53 in all)" in text(second)
    # a row's tenant link swaps the tenant for its id and keeps the other filters (and drops the page)
    tenant_link = kept.replace("tenant=acme", f"tenant={acme.pk}").replace("&", "&amp;")
    assert f'href="?{tenant_link}"' in text(second)


def test_the_target_filter(readonly_client, tenants, trail):
    acme, globex = tenants
    assert seqs(readonly_client.get(EVENTS, {"target": f"tenant:{globex.pk}"})) == [trail[2].seq]
    assert seqs(readonly_client.get(EVENTS, {"target": "tenant"})) == [e.seq for e in trail[::-1]]
    assert seqs(readonly_client.get(EVENTS, {"target": "node"})) == []
    refused = readonly_client.get(EVENTS, {"target": "Not a target!"})
    assert refused.status_code == 400 and "A target is `type` or `type:id`" in text(refused)


# ---- names beside the ids --------------------------------------------------------------------------------------------


def event(*, actor: Actor, target_type: str, target_id="", tenant_id=None, action=AuditAction.QUOTA_UPDATED):
    with transaction.atomic(), acting_as(actor):
        return audit_record(
            action=action, target_type=target_type, target_id=target_id, tenant_id=tenant_id, new={"n": 1}
        )


def a_key(tenant, name: str) -> ApiKey:
    return ApiKey.objects.get(
        pk=tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read"], name=name).api_key.pk
    )


@pytest.fixture
def named(tenants):
    """Events whose actors and targets are a console user, an API key, a node, a cache and a tenant."""
    acme, globex = tenants
    alice = get_user_model().objects.create_user("alice-operator")
    key = a_key(acme, "ci-deployer")
    node = make_node("gpu-node-7")
    cache = attach(acme, "llama-prefixes")
    return {
        "alice": alice,
        "key": key,
        "node": node,
        "cache": cache,
        "events": [
            event(actor=Actor("user", str(alice.pk)), target_type="tenant", target_id=globex.pk, tenant_id=globex.pk),
            event(actor=Actor("key", key.public_id), target_type="api_key", target_id=key.pk, tenant_id=acme.pk),
            event(actor=Actor("node", str(node.pk)), target_type="cache", target_id=cache.pk, tenant_id=acme.pk),
            event(actor=Actor("user", str(alice.pk)), target_type="node", target_id=node.pk),
        ],
    }


def cells(response, label: str) -> list[str]:
    """The text of every cell of one column (tags dropped, whitespace collapsed), top row first."""
    found = re.findall(rf'<td data-label="{label}">(.*?)</td>', text(response), flags=re.S)
    return [" ".join(re.sub(r"<[^>]+>", " ", cell).split()) for cell in found]


def test_actors_tenants_and_targets_are_named_beside_their_ids(readonly_client, tenants, named):
    acme, globex = tenants
    page = readonly_client.get(EVENTS, {"from": iso(named["events"][0].occurred_at)})
    alice, key, node, cache = named["alice"], named["key"], named["node"], named["cache"]
    assert cells(page, "Actor") == [
        f"alice-operator user:{alice.pk}",
        f"gpu-node-7 node:{str(node.pk)[:8]}…",
        f"ci-deployer (acme) key:{key.public_id[:8]}…",
        f"alice-operator user:{alice.pk}",
    ]
    assert cells(page, "Tenant") == [
        "none",
        f"acme {str(acme.pk)[:8]}…",
        f"acme {str(acme.pk)[:8]}…",
        f"globex {str(globex.pk)[:8]}…",
    ]
    assert cells(page, "Target") == [
        f"gpu-node-7 node:{str(node.pk)[:8]}…",
        f"llama-prefixes (acme) cache:{str(cache.pk)[:8]}…",
        f"ci-deployer (acme) api_key:{str(key.pk)[:8]}…",
        f"globex tenant:{str(globex.pk)[:8]}…",
    ]
    body = text(page)
    # the whole ids stay on the page: in the links' titles and under "More"
    assert f'title="Show only the events about node:{node.pk}"' in body
    assert f'title="Show only the events of node:{node.pk}"' in body
    assert f"<code>cache:{cache.pk}</code>" in body and f"<code>{acme.pk}</code>" in body
    assert f'&amp;actor=node%3A{node.pk}"' in body and f'&amp;target=cache%3A{cache.pk}"' in body  # filter links


def test_names_cost_a_constant_number_of_queries_per_page(readonly_client, tenants):
    acme, _ = tenants
    readonly_client.get(EVENTS)  # the session's first-request work done

    def queries_for_page() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert readonly_client.get(EVENTS).status_code == 200
        return len(captured)

    users = get_user_model().objects
    first_user = users.create_user("only-one")
    event(actor=Actor("user", str(first_user.pk)), target_type="tenant", target_id=acme.pk, tenant_id=acme.pk)
    one_row = queries_for_page()
    for n in range(12):  # every row names other objects of every kind
        tenant = Tenant.objects.create(name=f"many-{n}")
        user = users.create_user(f"user-{n}")
        key = a_key(tenant, f"key-{n}")
        node = make_node(f"node-{n}")
        cache = attach(tenant, f"cache-{n}")
        event(actor=Actor("user", str(user.pk)), target_type="api_key", target_id=key.pk, tenant_id=tenant.pk)
        event(actor=Actor("key", key.public_id), target_type="cache", target_id=cache.pk, tenant_id=tenant.pk)
        event(actor=Actor("node", str(node.pk)), target_type="node", target_id=node.pk)
        event(actor=Actor("user", str(user.pk)), target_type="console_user", target_id=str(user.pk))
    assert AuditEvent.objects.count() > 50
    many_rows = queries_for_page()
    assert many_rows == one_row + 3, (one_row, many_rows)  # + keys, nodes, caches: one query each, not one per row
    page = readonly_client.get(EVENTS)
    assert "key-11 (many-11)" in text(page) and "cache-11 (many-11)" in text(page) and "node-11" in text(page)


def test_gone_objects_show_their_id_and_deleted_and_nothing_erasure_removed(readonly_client, tenants, named):
    acme, globex = tenants
    alice_pk = named["alice"].pk
    named["alice"].delete()
    ghost_node = "6c6f7374-0000-4000-8000-000000000001"
    event(actor=Actor("node", ghost_node), target_type="node", target_id=ghost_node)
    Tenant.objects.filter(pk=acme.pk).update(name="erased-0123456789", status=Tenant.Status.ERASED)
    ApiKey.objects.filter(tenant=acme).update(name="")
    page = readonly_client.get(EVENTS, {"from": iso(named["events"][0].occurred_at)})
    key, cache = named["key"], named["cache"]
    assert cells(page, "Actor") == [
        f"node:{ghost_node[:8]}… (deleted)",
        f"user:{alice_pk} (deleted)",
        f"gpu-node-7 node:{str(named['node'].pk)[:8]}…",
        f"key:{key.public_id[:8]}… (deleted)",
        f"user:{alice_pk} (deleted)",
    ]
    assert cells(page, "Tenant")[2:] == [f"{str(acme.pk)[:8]}… (deleted)"] * 2 + [f"globex {str(globex.pk)[:8]}…"]
    assert cells(page, "Target")[2:4] == [
        f"cache:{str(cache.pk)[:8]}… (deleted)",
        f"api_key:{str(key.pk)[:8]}… (deleted)",
    ]
    body = text(page)
    for erased in ("erased-0123456789", "acme", "llama-prefixes", "ci-deployer"):
        assert erased not in body, erased


def test_a_pseudonymised_events_ids_name_nothing(readonly_client):
    pseudonym = "70736575-646f-4000-8000-000000000002"
    event(actor=Actor("key", f"pseudonym:{pseudonym}"), target_type="tenant", target_id=pseudonym, tenant_id=pseudonym)
    page = readonly_client.get(EVENTS, {"action": "quota.updated"})
    assert cells(page, "Actor") == ["key:pseudony… (deleted)"]
    assert cells(page, "Tenant") == [f"{pseudonym[:8]}… (deleted)"]


def test_names_are_escaped(readonly_client):
    evil = Tenant.objects.create(name='<script>alert("t")</script>')
    key = ApiKey.objects.create(
        tenant=evil,
        name="<img src=x onerror=alert(1)>",
        public_id="evilkey01",
        secret_hash="0" * 64,
        scopes=["caches:read"],
    )
    event(actor=Actor("key", key.public_id), target_type="api_key", target_id=key.pk, tenant_id=evil.pk)
    body = text(readonly_client.get(EVENTS))
    assert "<script>alert" not in body and "<img src=x" not in body
    assert "&lt;script&gt;alert(&quot;t&quot;)&lt;/script&gt;" in body
    assert "&lt;img src=x onerror=alert(1)&gt; (&lt;script&gt;" in body


# ---- roles -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [roles.READ_ONLY, roles.OPERATOR])
def test_read_only_and_operator_see_events_but_cannot_export_or_verify(console_client, trail, role):
    client = console_client(role)
    page = client.get(EVENTS)
    assert page.status_code == 200 and "Export these events" not in text(page)
    for answer in (
        client.get(EXPORT),
        client.post(EXPORT, {"format": "jsonl"}),
        client.get(VERIFY),
        client.post(VERIFY, {"export": SimpleUploadedFile("e.jsonl", b"{}")}),
    ):
        assert answer.status_code == 403 and "Your console role does not allow this." in text(answer)
    assert exported_events() == []


def test_signed_out_users_are_sent_to_sign_in(client, trail):
    for url in (EVENTS, EXPORT, VERIFY):
        assert client.get(url).status_code == 302
    assert client.post(EXPORT, {"format": "jsonl"}).status_code == 302
    assert exported_events() == []


# ---- export ----------------------------------------------------------------------------------------------------------


def test_the_export_form_is_prefilled_from_the_events_filters(compliance_client, trail):
    events = compliance_client.get(EVENTS, {"tenant": "acme", "actor": "key"})
    assert f'href="{EXPORT}?tenant=acme"' in text(events)
    form = compliance_client.get(EXPORT, {"tenant": "acme", "from": "2026-01-02T03:04"})
    assert form.status_code == 200
    assert 'value="acme"' in text(form) and 'value="2026-01-02T03:04"' in text(form)
    assert compliance_client.head(EXPORT).status_code == 200
    assert exported_events() == []  # showing the form records nothing


def test_a_jsonl_export_verifies_and_records_the_export_by_the_user(compliance_client, trail):
    before = AuditEvent.objects.count()
    response = compliance_client.post(EXPORT, {"format": "jsonl"})
    assert response["Content-Type"] == "application/x-ndjson; charset=utf-8"
    assert re.match(r'attachment; filename="kcaas-audit-\d{8}T\d{6}Z\.jsonl"', response["Content-Disposition"])
    content = downloaded(response)
    report = chain.verify_export(content.splitlines(keepends=True), trusted_key_jwk=platform_public_jwk())
    assert report.ok and report.events == before and report.witnesses == 0, report.summary()
    [exported] = exported_events()
    assert (exported.actor_kind, exported.actor_id) == ("user", str(compliance_client.user.pk))
    assert exported.new_values["format"] == "jsonl" and exported.new_values["tenant_id"] is None
    assert exported.new_values["last_seq"] == before  # the export does not hold its own event


def test_a_csv_tenant_export_holds_its_events_and_witnesses(compliance_client, tenants, trail):
    acme, globex = tenants
    response = compliance_client.post(EXPORT, {"format": "csv", "tenant": "acme", "from": iso(trail[0].occurred_at)})
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    content = downloaded(response)
    assert str(acme.pk) in content and str(globex.pk) not in content
    report = chain.verify_export(content.splitlines(keepends=True), trusted_key_jwk=platform_public_jwk())
    assert report.ok and report.events == 2 and report.witnesses == 2, report.summary()
    [exported] = exported_events()
    assert exported.tenant_id == acme.pk and exported.new_values["format"] == "csv"
    assert exported.actor_id == str(compliance_client.user.pk)


def test_the_console_and_the_rest_export_are_the_same_file(compliance_client, staff, trail):
    end = datetime.now(UTC)
    console = downloaded(compliance_client.post(EXPORT, {"format": "jsonl", "to": iso(end)}))
    rest = b"".join(
        staff.client.get("/api/v1/audit/export", {"format": "jsonl", "to": end.isoformat()}).streaming_content
    ).decode()

    def without_generated_at(export: str) -> list[dict]:
        """The records but the header's generation time and the signature (which signs that time too)."""
        records = [json.loads(line) for line in export.splitlines()]
        records[0].pop("generated_at")
        assert records[-1]["record_type"] == "signature"
        return records[:-1]

    assert without_generated_at(console) == without_generated_at(rest)
    for export in (console, rest):
        assert chain.verify_export(export.splitlines(keepends=True)).export_signed
    assert [(e.actor_kind, e.actor_id) for e in exported_events()] == [
        ("user", str(compliance_client.user.pk)),
        ("user", str(staff.user.pk)),
    ]


@pytest.mark.parametrize(
    "form, message",
    [
        ({"format": "xml"}, "Select a valid choice."),
        ({"format": "jsonl", "from": "2030-01-01T00:00", "to": "2029-01-01T00:00"}, "must be after"),
        ({"format": "jsonl", "from": "2999-01-01T00:00"}, "must be in the past"),
        ({"format": "jsonl", "from": "soon"}, "Enter a valid date/time."),
        ({"format": "jsonl", "tenant": "initech"}, "No such tenant"),
    ],
)
def test_a_bad_export_form_is_a_400_and_records_nothing(compliance_client, trail, form, message):
    answer = compliance_client.post(EXPORT, form)
    assert answer.status_code == 400 and message in text(answer) and "The export was not started" in text(answer)
    assert exported_events() == []


def test_the_export_needs_the_csrf_token(console_client, trail):
    client = console_client(roles.COMPLIANCE, csrf=True)
    assert client.post(EXPORT, {"format": "jsonl"}).status_code == 403
    assert exported_events() == []
    answer = client.post(EXPORT, {"format": "jsonl", "csrfmiddlewaretoken": csrf_token(client)})
    assert chain.verify_export(downloaded(answer).splitlines(keepends=True)).ok
    assert len(exported_events()) == 1


# ---- verify ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def signed_trail(trail, settings):
    """The trail signed by one-second digests, then one event more (not yet signed)."""
    settings.KCAAS_AUDIT_DIGEST_SECONDS = 1
    next_second()
    assert audit_digest_sign()
    record(trail[0].tenant_id)


def export_lines(client, fmt="jsonl") -> list[str]:
    return downloaded(client.post(EXPORT, {"format": fmt})).splitlines(keepends=True)


def upload(client, content: bytes | str, name="export.jsonl"):
    data = content.encode() if isinstance(content, str) else content
    return client.post(VERIFY, {"export": SimpleUploadedFile(name, data)})


def chain_break(page) -> tuple[int, str]:
    assert page.status_code == 200, page.content[:2000]
    body = text(page)
    assert "FAILED" in body and "OK: the export verifies" not in body
    found = re.search(r"The chain breaks at event seq (\d+): ([a-z_]+): ", body)
    assert found, body
    return int(found.group(1)), found.group(2)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_good_export_verifies(compliance_client, signed_trail, fmt):
    lines = export_lines(compliance_client, fmt)
    page = upload(compliance_client, "".join(lines), f"export.{fmt}")
    assert page.status_code == 200, page.content[:2000]
    body = text(page)
    report = chain.verify_export(lines, trusted_key_jwk=platform_public_jwk())
    assert report.ok and report.digests > 0
    assert "OK: the export verifies" in body and "FAILED" not in body
    assert f"<dt>Events</dt><dd>{report.events}</dd>" in body and f"<dt>Digests</dt><dd>{report.digests}</dd>" in body
    assert f"{report.first_seq} – {report.last_seq}" in body and platform_public_jwk()["kid"] in body
    # what signs what, as the CLI's summary says it: signed spans, the chained-only tail, the export's signature
    assert "<dt>Signed by a digest</dt><dd>seq " in body and "<dt>Export signature</dt><dd>verified</dd>" in body
    assert "<dt>Chained only, not yet signed</dt>" in body


def event_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if json.loads(line)["record_type"] == "event"]


def test_a_changed_field_is_named_by_seq(compliance_client, signed_trail):
    lines = export_lines(compliance_client)
    index = event_lines(lines)[2]
    tampered = json.loads(lines[index])
    tampered["actor_id"] = "k-forged"
    lines[index] = chain.canonical(tampered).decode() + "\n"
    assert chain_break(upload(compliance_client, "".join(lines))) == (tampered["seq"], "commitment_mismatch")
    tampered["action"] = int(AuditAction.TENANT_CREATED)
    lines[index] = chain.canonical(tampered).decode() + "\n"
    page = upload(compliance_client, "".join(lines))
    assert chain_break(page)[0] == tampered["seq"] and "hash_mismatch" in text(page)


def test_a_deleted_line_is_named_by_the_seq_after_the_gap(compliance_client, signed_trail):
    lines = export_lines(compliance_client)
    index = event_lines(lines)[1]
    gone = json.loads(lines.pop(index))["seq"]
    page = upload(compliance_client, "".join(lines))
    assert chain_break(page) == (gone + 1, "deleted")
    assert f"seq {gone} missing before it" in text(page) and "header_mismatch" in text(page)


def test_the_earliest_break_in_the_chain_is_the_one_shown_first(compliance_client, signed_trail):
    lines = export_lines(compliance_client)
    first, third = event_lines(lines)[0], event_lines(lines)[2]
    tampered = json.loads(lines[first])
    tampered["target_id"] = "elsewhere"
    lines[first] = chain.canonical(tampered).decode() + "\n"
    gone = json.loads(lines.pop(third))["seq"]  # the verifier reports this one before the tampered event
    page = upload(compliance_client, "".join(lines))
    assert chain_break(page) == (tampered["seq"], "commitment_mismatch")
    assert f"seq {gone} missing before it" in text(page)


def test_reordered_lines_are_named_by_seq(compliance_client, signed_trail):
    lines = export_lines(compliance_client)
    first, second = event_lines(lines)[1:3]
    lines[first], lines[second] = lines[second], lines[first]
    earlier = json.loads(lines[second])["seq"]
    assert chain_break(upload(compliance_client, "".join(lines))) == (earlier, "reordered")


def other_key_pem() -> str:
    return (
        Ed25519PrivateKey.generate()
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )


def test_an_export_resigned_with_another_key_is_untrusted(compliance_client, signed_trail):
    records = [json.loads(line) for line in export_lines(compliance_client)]
    forger = Ed25519PrivateKey.generate()
    forged_key = public_jwk_of(forger.public_key())
    records[0]["platform_key"] = forged_key
    digests = [r for r in records if r["record_type"] == "digest"]
    assert digests
    prev_digest_hash = digests[0]["prev_digest_hash"]
    for digest in digests:  # the trail may span one or two periods: re-chain each forged digest to the one before
        body = chain.digest_body(
            **{k: digest[k] for k in ("period_start", "period_end", "head_seq", "head_hash")},
            prev_digest_hash=prev_digest_hash,
            key_id=forged_key["kid"],
        )
        digest.update(key_id=forged_key["kid"], signature=b64url(forger.sign(chain.canonical(body))))
        digest.update(prev_digest_hash=prev_digest_hash, digest_hash=chain.digest_hash(body))
        prev_digest_hash = digest["digest_hash"]
    signature = records[-1]  # and the export's own signature, over the forged records
    signature["records_hash"] = chain.records_hash(records[:-1])
    body = chain.export_signature_body(records_hash=signature["records_hash"], key_id=forged_key["kid"])
    signature.update(key_id=forged_key["kid"], signature=b64url(forger.sign(chain.canonical(body))))
    forged = "".join(chain.canonical(r).decode() + "\n" for r in records)
    assert chain.verify_export(forged.splitlines(keepends=True)).ok  # self-consistent under its own key
    page = upload(compliance_client, forged)
    assert page.status_code == 200 and "FAILED" in text(page) and "untrusted_key" in text(page)
    assert "The export fails verification: untrusted_key" in text(page)


def test_an_export_checked_against_another_platform_key_is_untrusted(compliance_client, signed_trail, settings):
    lines = export_lines(compliance_client)
    settings.KCAAS_PLATFORM_SIGNING_KEY_PEM = other_key_pem()  # this platform's key is now another one
    page = upload(compliance_client, "".join(lines))
    assert page.status_code == 200 and "untrusted_key" in text(page) and "digest_signature_invalid" in text(page)
    assert platform_public_jwk()["kid"] in text(page)


@pytest.mark.parametrize(
    "content, shown",
    [
        (b"\xff\xfe\x00\x01binary\x00", "the file is not UTF-8 text"),
        (b"hello, world\nthis is not an export\n", "malformed"),
        (b'{"record_type": "header"}\n{not json\n', "malformed"),
        (b'{"a":' + b"[" * 200_000, "malformed"),
        ("\u2028{}".encode(), "malformed"),
    ],
)
def test_garbage_is_a_failed_malformed_result(compliance_client, content, shown):
    page = upload(compliance_client, content)
    assert page.status_code == 200, page.content[:2000]
    assert "FAILED" in text(page) and shown in text(page) and "OK: the export verifies" not in text(page)


def test_an_empty_or_missing_file_is_a_form_error(compliance_client):
    empty = upload(compliance_client, b"")
    assert empty.status_code == 400 and "The file is empty" in text(empty)
    missing = compliance_client.post(VERIFY, {})
    assert missing.status_code == 400 and "Choose an export file to verify." in text(missing)


def test_an_oversize_upload_is_refused(compliance_client, signed_trail, settings):
    lines = export_lines(compliance_client)
    settings.KCAAS_CONSOLE_AUDIT_VERIFY_MAX_BYTES = 1000
    small_body = upload(compliance_client, "".join(lines) + " " * 2000)  # refused while reading the body
    assert small_body.status_code == 413 and "larger than the 1000 bytes" in text(small_body)
    declared = upload(compliance_client, b"x" * (200 * 1024))  # refused from its Content-Length, unread
    assert declared.status_code == 413 and "File too large" in text(declared)
    settings.KCAAS_CONSOLE_AUDIT_VERIFY_MAX_BYTES = 10 * 1024 * 1024
    assert "OK: the export verifies" in text(upload(compliance_client, "".join(lines)))


def test_verify_needs_the_csrf_token(console_client, signed_trail):
    client = console_client(roles.COMPLIANCE, csrf=True)
    lines = export_lines_with_token(client)
    refused = client.post(VERIFY, {"export": SimpleUploadedFile("e.jsonl", "".join(lines).encode())})
    assert refused.status_code == 403
    accepted = client.post(
        VERIFY,
        {"export": SimpleUploadedFile("e.jsonl", "".join(lines).encode()), "csrfmiddlewaretoken": csrf_token(client)},
    )
    assert accepted.status_code == 200 and "OK: the export verifies" in text(accepted)


def export_lines_with_token(client) -> list[str]:
    answer = client.post(EXPORT, {"format": "jsonl", "csrfmiddlewaretoken": csrf_token(client)})
    return downloaded(answer).splitlines(keepends=True)


def test_the_verify_form_is_accessible(compliance_client):
    page = compliance_client.get(VERIFY)
    body = text(page)
    assert page.status_code == 200 and 'enctype="multipart/form-data"' in body
    assert '<label for="id_export">' in body and 'type="file"' in body and "csrfmiddlewaretoken" in body
    assert "64 MiB" in body
