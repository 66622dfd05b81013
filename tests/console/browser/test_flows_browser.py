"""What operators and compliance officers do in the console, in chromium, and what the API does afterwards:
change a quota and see the API enforce it, revoke a key and see the API refuse it, cordon a node, export and verify
an audit trail, start and cancel an erasure. Screenshots of the main pages come from these runs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from console import roles
from privacy.models import ErasureJob
from tenants import services as tenant_services
from tenants.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)
SPEC = {
    "model_fingerprint": "tiny@1",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "block_size": 16,
    "kv_dtype": "float16",
    "storage_dtype": "float16",
}


def api(base: str, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    """One real HTTP request to the live control plane with a tenant key: (status, JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        base + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def tenant_with_key(name: str):
    tenant = tenant_services.tenant_create(name=name)
    issued = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:write", "keys:read"], name="engine")
    return tenant, issued


def test_start_and_cancel_an_erasure(signed_in, shots):
    page, user = signed_in(roles.COMPLIANCE)
    tenant, _ = tenant_with_key("acme-robotics")
    page.goto(page.base + "/console/gdpr/")
    page.get_by_role("link", name="Request an erasure…").click()
    page.get_by_label("Tenant name or id").fill("acme-robotics")
    page.get_by_role("button", name="Continue").click()
    page.get_by_label("Type acme-robotics to confirm").fill("acme")  # a slip of the keyboard
    page.get_by_role("button", name="Request erasure").click()
    assert not ErasureJob.objects.exists()
    page.get_by_label("Type acme-robotics to confirm").fill("acme-robotics")
    page.get_by_role("button", name="Request erasure").click()
    page.wait_for_url("**/console/gdpr/")
    assert "scheduled" in page.locator(".messages").inner_text()
    job = ErasureJob.objects.get(tenant_id=tenant.pk)
    assert job.state == "scheduled" and job.requested_by == f"user:{user.pk}"
    row = page.get_by_role("row").filter(has_text="acme-robotics")
    assert "scheduled" in row.inner_text()
    page.screenshot(path=str(shots / "gdpr-flow.png"), full_page=True)

    row.get_by_role("link", name="Cancel…").click()
    page.get_by_role("button", name="Cancel the erasure").click()
    page.wait_for_url("**/console/gdpr/")
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert "cancelled" in page.get_by_role("row").filter(has_text="acme-robotics").inner_text()
    assert Tenant.objects.get(pk=tenant.pk).status == "active"
    assert not page.js_errors


def test_change_a_quota_and_the_api_enforces_it(signed_in, shots):
    page, user = signed_in(roles.OPERATOR)
    tenant, issued = tenant_with_key("quota-co")
    attach = {"name": "c1", "spec": SPEC, "capacity": {"device": 1 << 20}}
    status, body = api(page.base, "POST", "/api/v1/caches", issued.raw_key, attach)
    assert body["error"]["code"] != "quota_exceeded"  # no node takes it yet, but the quota lets it through

    page.goto(page.base + "/console/tenants/")
    page.get_by_label("Name or id").fill("quota")
    page.keyboard.press("Enter")
    page.get_by_role("link", name="quota-co").click()
    page.get_by_label("Device bytes").fill("-1")
    page.get_by_role("button", name="Save quota").click()
    assert "The quota was not changed" in page.get_by_role("alert").filter(has_text="quota").first.inner_text()
    page.get_by_label("Device bytes").fill("lots")
    page.get_by_role("button", name="Save quota").click()
    assert page.locator(".field-error").count() >= 1
    status, body = api(page.base, "POST", "/api/v1/caches", issued.raw_key, attach)
    assert body["error"]["code"] != "quota_exceeded"  # refused input changed nothing

    page.get_by_label("Device bytes").fill("64 KiB")
    page.get_by_role("button", name="Save quota").click()
    assert "64 KiB" in page.locator(".messages").inner_text() or "65536" in page.locator(".messages").inner_text()
    status, body = api(page.base, "POST", "/api/v1/caches", issued.raw_key, attach)
    assert (status, body["error"]["code"]) == (403, "quota_exceeded")
    assert not page.js_errors


def test_revoke_a_key_and_the_api_refuses_it(signed_in):
    page, user = signed_in(roles.OPERATOR)
    tenant, issued = tenant_with_key("revoke-co")
    assert api(page.base, "GET", "/api/v1/keys", issued.raw_key)[0] == 200
    page.goto(page.base + f"/console/tenants/{tenant.pk}/")
    assert issued.raw_key not in page.content()
    page.get_by_role("link", name=f"Revoke key {issued.api_key.public_id}").click()
    assert api(page.base, "GET", "/api/v1/keys", issued.raw_key)[0] == 200  # the confirmation step changed nothing
    page.get_by_role("button", name="Revoke key").click()
    page.wait_for_url(f"**/console/tenants/{tenant.pk}/#keys")
    assert "revoked" in page.get_by_role("row").filter(has_text=issued.api_key.public_id).inner_text()
    status, body = api(page.base, "GET", "/api/v1/keys", issued.raw_key)
    assert status == 401
    assert not page.js_errors


def test_cordon_a_node_and_placement_skips_it(signed_in, shots):
    from tests.console.nodes_fixtures import make_node

    page, user = signed_in(roles.OPERATOR)
    node = make_node("gpu-a1")
    tenant, issued = tenant_with_key("placement-co")
    page.goto(page.base + "/console/nodes/")
    page.get_by_role("link", name="gpu-a1").click()
    page.get_by_role("link", name="Cordon").click()
    node.refresh_from_db()
    assert node.state == "ready"  # the confirmation page changed nothing
    page.get_by_role("button", name="Cordon").click()
    assert "ready -> cordoned" in page.locator(".messages").inner_text()
    node.refresh_from_db()
    assert node.state == "cordoned"
    status, body = api(
        page.base,
        "POST",
        "/api/v1/caches",
        issued.raw_key,
        {"name": "c1", "spec": SPEC, "capacity": {"device": 1 << 20}},
    )
    assert (status, body["error"]["code"]) == (503, "no_capacity")  # the only node is cordoned
    page.get_by_role("link", name="Uncordon").click()
    page.get_by_role("button", name="Uncordon").click()
    assert "cordoned -> ready" in page.locator(".messages").inner_text()
    assert not page.js_errors


def test_export_an_audit_trail_and_verify_it_then_a_tampered_copy(signed_in, shots, tmp_path):
    page, user = signed_in(roles.COMPLIANCE)
    for name in ("alpha-co", "beta-co"):
        tenant_with_key(name)
    page.goto(page.base + "/console/audit/")
    page.get_by_role("link", name="Export these events").click()
    page.get_by_label("Format").select_option("jsonl")
    with page.expect_download() as download_info:
        page.get_by_role("button", name="Download the export").click()
    exported = tmp_path / download_info.value.suggested_filename
    download_info.value.save_as(exported)
    lines = exported.read_text().splitlines()
    assert json.loads(lines[0])["record_type"] == "header" and len(lines) > 5

    page.goto(page.base + "/console/audit/verify")
    page.get_by_label("Export file (JSONL or CSV)").set_input_files(str(exported))
    page.get_by_role("button", name="Verify").click()
    assert "OK: the export verifies." in page.locator("main").inner_text()
    page.screenshot(path=str(shots / "audit-verify-ok.png"), full_page=True)

    records = [json.loads(line) for line in lines]
    victim = next(r for r in records if r.get("record_type") == "event" and r.get("action") == 1001)  # tenant.created
    victim["target_id"] = "00000000-0000-0000-0000-000000000000"
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in records))
    page.get_by_label("Export file (JSONL or CSV)").set_input_files(str(tampered))
    page.get_by_role("button", name="Verify").click()
    verdict = page.get_by_role("alert").filter(has_text="The chain breaks at event seq").inner_text()
    assert f"The chain breaks at event seq {victim['seq']}:" in verdict
    page.screenshot(path=str(shots / "audit-verify-broken.png"), full_page=True)
    assert not page.js_errors
