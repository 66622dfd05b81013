"""The sign-in a person does in chromium: enrol an authenticator from the page's own key, then sign in with codes;
keyboard reachability; laptop and phone widths."""

from __future__ import annotations

import base64

import pytest
from django_otp.oath import TOTP

from audit.actions import AuditAction
from audit.models import AuditEvent
from console import roles
from tests.console.browser.conftest import PHONE, accessibility_problems, browser_sign_in
from tests.console.conftest import PASSWORD, make_console_user

pytestmark = pytest.mark.django_db(transaction=True)


def _code_from_shown_key(shown: str) -> str:
    """What an authenticator app computes from the key the page shows (base32, grouped by four)."""
    text = shown.replace(" ", "")
    key = base64.b32decode(text + "=" * (-len(text) % 8))
    return f"{TOTP(key).token():06d}"


def test_first_sign_in_enrols_from_the_page_then_signs_in_with_totp(page, shots):
    user, _ = make_console_user(roles.OPERATOR, enrolled=False)
    page.goto(page.base + "/console/")
    assert "/console/login" in page.url
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill("not the password")
    page.get_by_role("button", name="Continue").click()
    assert page.locator("#login-error").inner_text() == "Wrong username, password or code."
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Continue").click()
    page.wait_for_url("**/console/login/enroll**")
    assert page.locator("figure.qr svg").count() == 1
    page.screenshot(path=str(shots / "sign-in-enrol.png"))
    right = _code_from_shown_key(page.locator("#totp-secret").inner_text())
    page.get_by_label("6-digit code").fill(f"{(int(right) + 1) % 1_000_000:06d}")
    page.get_by_role("button", name="Confirm and sign in").click()
    assert "Wrong username, password or code." in page.locator("#login-error").inner_text()
    page.wait_for_timeout(1100)  # django-otp's throttle after one wrong code (1 s)
    page.get_by_label("6-digit code").fill(_code_from_shown_key(page.locator("#totp-secret").inner_text()))
    page.get_by_role("button", name="Confirm and sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()
    assert page.url.rstrip("/").endswith("/console")
    actions = list(AuditEvent.objects.order_by("seq").values_list("action", flat=True))
    assert actions.count(AuditAction.CONSOLE_LOGIN_FAILED) == 2 and actions[-1] == AuditAction.CONSOLE_LOGIN
    assert not page.js_errors

    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/console/login")
    assert AuditEvent.objects.order_by("-seq").first().action == AuditAction.CONSOLE_LOGOUT
    page.goto(page.base + "/console/nodes/")
    assert "/console/login" in page.url


def test_keyboard_reaches_the_content_and_every_section(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    page.keyboard.press("Tab")
    focused = page.evaluate("document.activeElement.textContent.trim()")
    assert focused == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    sections = page.get_by_role("navigation", name="Sections").get_by_role("link")
    assert sections.all_inner_texts() == ["Overview", "Tenants", "Nodes", "Audit", "GDPR"]


@pytest.mark.parametrize(
    "path", ["/console/", "/console/tenants/", "/console/nodes/", "/console/audit/", "/console/gdpr/"]
)
def test_main_pages_are_accessible_at_laptop_and_phone_width(signed_in, path):
    page, _ = signed_in(roles.OPERATOR, roles.COMPLIANCE)
    page.goto(page.base + path)
    assert accessibility_problems(page) == []
    page.set_viewport_size(PHONE)
    page.reload()
    assert accessibility_problems(page) == []
    assert not page.js_errors


def test_wrong_codes_are_throttled_in_the_page(page):
    user, device = make_console_user(roles.COMPLIANCE)
    page.goto(page.base + "/console/login")
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Continue").click()
    page.wait_for_url("**/console/login/verify**")
    page.get_by_label("6-digit code").fill("12345x")
    page.get_by_role("button", name="Sign in").click()
    assert page.get_by_text("Six digits.").is_visible()
    for _ in range(2):
        page.get_by_label("6-digit code").fill("000001")
        page.get_by_role("button", name="Sign in").click()
    assert "Too many wrong codes" in page.locator("#login-error").inner_text()
    page.wait_for_timeout(2100)  # two wrong codes: django-otp waits 2 s before the next try
    browser_sign_in(page, user, device)  # then the right code still works


def test_live_regions_refresh_by_htmx_polling_under_the_csp(signed_in):
    """htmx is served as a static file and runs under the strict CSP: the overview's live part shows a node that
    was cordoned after the page loaded, without a reload, and its polls do not count as activity."""
    from playwright.sync_api import expect

    from fleet import services as fleet_services
    from tests.console.nodes_fixtures import make_node

    node = make_node("gpu-live")
    page, _ = signed_in(roles.READ_ONLY)
    page.goto(page.base + "/console/")
    cordoned = page.locator('[data-node-state="cordoned"]')
    assert cordoned.inner_text() == "0"
    polls = []
    page.on(
        "request",
        lambda request: (
            polls.append(request.headers.get("x-console-poll")) if "/console/overview/live" in request.url else None
        ),
    )
    fleet_services.node_cordon(node_id=node.pk)
    expect(page.locator('[data-node-state="cordoned"]')).to_have_text("1", timeout=12_000)
    assert polls and all(header == "1" for header in polls)
    assert page.url.rstrip("/").endswith("/console")  # updated in place
    assert not page.js_errors
