"""Console sign-in: password then TOTP (or enrolment), audited; roles; expiry; CSRF; the REST API refuses console
credentials."""

from __future__ import annotations

import base64
import time

import pytest
from django.test import Client, override_settings

from audit.actions import AuditAction
from audit.models import AuditEvent
from console import roles, sessions
from console.models import ConsoleTOTPDevice as TOTPDevice
from tests.console.conftest import PASSWORD, csrf_token, make_console_user, sign_in, totp_code

pytestmark = pytest.mark.django_db


def _events(action: AuditAction) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=int(action)).order_by("seq"))


def test_password_then_code_signs_in_and_is_audited():
    user, device = make_console_user(roles.OPERATOR)
    client = sign_in(Client(), user, device)
    [login] = _events(AuditAction.CONSOLE_LOGIN)
    assert (login.actor_kind, login.actor_id, login.target_id) == ("user", str(user.pk), str(user.pk))
    assert login.new_values["roles"] == ["operator"]
    page = client.get("/console/")
    assert page.status_code == 200 and b"Sign out" in page.content
    assert page["Cache-Control"] == "no-store"
    assert "script-src 'self'" in page["Content-Security-Policy"] and page["X-Frame-Options"] == "DENY"


def test_pages_redirect_to_sign_in_and_htmx_gets_a_redirect_header(db):
    answer = Client().get("/console/tenants/")
    assert answer.status_code == 302 and answer["Location"].startswith("/console/login?next=")
    answer = Client().get("/console/", HTTP_HX_REQUEST="true")
    assert answer.status_code == 204 and answer["HX-Redirect"].startswith("/console/login")


@pytest.mark.parametrize("username,password", [("nobody", PASSWORD), ("real", "wrong password")])
def test_wrong_username_or_password_gives_one_answer_and_an_event(username, password):
    make_console_user(roles.OPERATOR, username="real")
    answer = Client().post("/console/login", {"username": username, "password": password})
    assert answer.status_code == 400 and b"Wrong username, password or code." in answer.content
    [failed] = _events(AuditAction.CONSOLE_LOGIN_FAILED)
    assert failed.new_values["step"] == "password"
    assert failed.new_values["username"] != username  # an HMAC: the typed text never enters the trail
    assert not _events(AuditAction.CONSOLE_LOGIN)


def test_password_alone_reaches_no_page():
    user, _ = make_console_user(roles.OPERATOR)
    client = Client()
    client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert client.get("/console/").status_code == 302
    assert client.get("/api/v1/admin/tenants").status_code in (401, 403)


def test_staff_without_a_console_role_cannot_sign_in():
    user, device = make_console_user()
    answer = Client().post("/console/login", {"username": user.username, "password": PASSWORD})
    assert answer.status_code == 400
    assert _events(AuditAction.CONSOLE_LOGIN_FAILED)


def test_wrong_code_is_refused_audited_and_throttled():
    user, device = make_console_user(roles.COMPLIANCE)
    client = Client()
    client.post("/console/login", {"username": user.username, "password": PASSWORD})
    wrong = f"{(int(totp_code(device)) + 1) % 1_000_000:06d}"
    answer = client.post("/console/login/verify", {"code": wrong})
    assert answer.status_code == 400
    assert b"Wrong username, password or code. Try again in 1 s." in answer.content  # django-otp's 1 s after one
    answer = client.post("/console/login/verify", {"code": totp_code(device)})  # within the throttle's wait
    assert answer.status_code == 400 and b"Too many wrong codes: try again in 1 s." in answer.content
    assert [e.new_values["step"] for e in _events(AuditAction.CONSOLE_LOGIN_FAILED)] == ["code", "code"]
    assert client.get("/console/").status_code == 302
    for bad in ("", "abcdef", "1234567890123", "12 34"):
        assert client.post("/console/login/verify", {"code": bad}).status_code == 400


def test_first_sign_in_enrols_an_authenticator():
    user, _ = make_console_user(roles.READ_ONLY, enrolled=False)
    client = Client()
    answer = client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert "/console/login/enroll" in answer["Location"]
    page = client.get("/console/login/enroll")
    assert page.status_code == 200 and b"<svg" in page.content and b"otpauth://totp/" in page.content
    device = TOTPDevice.objects.get(user=user, confirmed=False)
    shown = page.context["secret_b32"].replace(" ", "")
    assert base64.b32decode(shown + "=" * (-len(shown) % 8)) == device.bin_key
    answer = client.post("/console/login/enroll", {"code": totp_code(device)})
    assert answer.status_code == 302
    device.refresh_from_db()
    assert device.confirmed and client.get("/console/").status_code == 200
    assert len(_events(AuditAction.CONSOLE_LOGIN)) == 1


def test_enrolment_is_not_offered_once_a_device_is_confirmed():
    user, _ = make_console_user(roles.READ_ONLY)
    client = Client()
    client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert "/console/login/verify" in client.get("/console/login/enroll")["Location"]


def test_a_stale_password_step_must_be_repeated():
    user, device = make_console_user(roles.OPERATOR)
    client = Client()
    client.post("/console/login", {"username": user.username, "password": PASSWORD})
    session = client.session
    session[sessions.PENDING_AT] = time.time() - sessions.PENDING_SECONDS - 1
    session.save()
    answer = client.post("/console/login/verify", {"code": totp_code(device)})
    assert answer.status_code == 302 and answer["Location"] == "/console/login"
    assert not _events(AuditAction.CONSOLE_LOGIN)


def test_sign_out_is_a_post_and_is_audited(operator_client):
    assert operator_client.get("/console/logout").status_code == 405
    answer = operator_client.post("/console/logout")
    assert answer.status_code == 302
    [logout] = _events(AuditAction.CONSOLE_LOGOUT)
    assert logout.new_values == {"reason": "signed_out"} and logout.actor_id == str(operator_client.user.pk)
    assert operator_client.get("/console/").status_code == 302


def _age_session(client: Client, *, idle: float = 0, since_start: float = 0) -> None:
    session = client.session
    now = time.time()
    session[sessions.LAST_SEEN] = now - idle
    session[sessions.STARTED] = now - since_start
    session.save()


@override_settings(KCAAS_CONSOLE_IDLE_SECONDS=60, KCAAS_CONSOLE_MAX_SESSION_SECONDS=3600)
def test_idle_session_expires_and_polling_does_not_keep_it_alive(operator_client):
    _age_session(operator_client, idle=50, since_start=50)
    assert operator_client.get("/console/", HTTP_X_CONSOLE_POLL="1").status_code == 200
    _age_session(operator_client, idle=61, since_start=61)
    answer = operator_client.get("/console/")
    assert answer.status_code == 302 and "reason=expired" in answer["Location"]
    assert _events(AuditAction.CONSOLE_LOGOUT)[0].new_values == {"reason": "expired"}
    assert b"Your session expired" in operator_client.get(answer["Location"]).content


@override_settings(KCAAS_CONSOLE_IDLE_SECONDS=600, KCAAS_CONSOLE_MAX_SESSION_SECONDS=3600)
def test_session_ends_at_its_maximum_age_even_when_busy(operator_client):
    _age_session(operator_client, idle=1, since_start=3601)
    assert operator_client.get("/console/").status_code == 302


def test_csrf_is_enforced_on_console_forms(console_client):
    client = console_client(roles.OPERATOR, csrf=True)
    refused = client.post("/console/logout")
    assert refused.status_code == 403 and b"nothing was changed" in refused.content
    assert not _events(AuditAction.CONSOLE_LOGOUT)
    assert client.post("/console/logout", {"csrfmiddlewaretoken": csrf_token(client)}).status_code == 302


def test_rest_api_refuses_console_sessions_and_console_passwords(operator_client):
    assert operator_client.get("/api/v1/admin/tenants").status_code in (401, 403)
    user, _ = make_console_user(roles.OPERATOR)
    basic = base64.b64encode(f"{user.username}:{PASSWORD}".encode()).decode()
    assert Client().get("/api/v1/admin/tenants", HTTP_AUTHORIZATION=f"Basic {basic}").status_code == 401


def test_unknown_console_url_is_a_console_404(operator_client):
    answer = operator_client.get("/console/no/such/page")
    assert answer.status_code == 404 and b"There is no such console page." in answer.content
    assert b'<nav aria-label="Sections">' in answer.content and b"Sign out" in answer.content  # the layout kept
    assert answer["Cache-Control"] == "no-store"


def test_unknown_console_url_signed_out_has_no_navigation(db):
    answer = Client().get("/console/no/such/page")
    assert answer.status_code == 404 and b"There is no such console page." in answer.content
    assert b'<nav aria-label="Sections">' not in answer.content


@override_settings(KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE=3)
def test_password_tries_are_rate_limited_per_username(redis_client):
    user, device = make_console_user(roles.OPERATOR)
    client = Client()
    for _ in range(3):
        assert client.post("/console/login", {"username": user.username, "password": "guess"}).status_code == 400
    refused = client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert refused.status_code == 429 and b"Too many sign-in attempts" in refused.content
    assert client.get("/console/").status_code == 302  # not even the right password gets through now
    other, other_device = make_console_user(roles.OPERATOR)
    sign_in(Client(), other, other_device)  # another username is not held back
    assert not redis_client.keys(f"*{user.username}*")  # the bucket is named by an HMAC, not the username
