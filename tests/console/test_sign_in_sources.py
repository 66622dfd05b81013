"""The console's password step against password spraying: failed sign-ins limited per source address as well as per
username, checked before any password hash, every refusal the same page; counted failures audited as before
(console.login_failed, step "password"), throttled tries recorded once a minute (step "throttled")."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from audit.actions import AuditAction
from audit.models import AuditEvent
from console import roles
from tests.console.conftest import PASSWORD, make_console_user
from tests.controlplane.test_password_door import CountingHasher

pytestmark = pytest.mark.django_db
SOURCE_LIMIT = 30  # settings.KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE (per 10 minutes)


@pytest.fixture
def hashes(settings, redis_client):
    settings.PASSWORD_HASHERS = ["tests.controlplane.test_password_door.CountingHasher"]

    def count() -> int:
        return CountingHasher.count

    count.reset = lambda: setattr(CountingHasher, "count", 0)
    return count


def _post(source: str, username: str, password: str, **extra):
    return Client(REMOTE_ADDR=source).post("/console/login", {"username": username, "password": password}, **extra)


def _failed_steps() -> list[str]:
    events = AuditEvent.objects.filter(action=int(AuditAction.CONSOLE_LOGIN_FAILED)).order_by("seq")
    return [event.new_values["step"] for event in events]


def test_one_password_sprayed_over_many_usernames_is_throttled_per_source(hashes):
    user, _ = make_console_user(roles.OPERATOR)
    hashes.reset()
    for i in range(SOURCE_LIMIT):  # each username tried once: the per-username limit never sees more than one
        answer = _post("198.51.100.20", f"victim{i}", "Winter2025!")
        assert answer.status_code == 400 and b"Wrong username, password or code." in answer.content
    assert hashes() == SOURCE_LIMIT
    refused = _post("198.51.100.20", user.username, PASSWORD)  # even the right password of a real user
    assert refused.status_code == 429 and b"Too many sign-in attempts" in refused.content
    assert int(refused["Retry-After"]) >= 1
    assert hashes() == SOURCE_LIMIT  # refused before the password was hashed
    assert _failed_steps() == ["password"] * SOURCE_LIMIT + ["throttled"]
    # From another address the user signs in; the sprayer's address stays held.
    answer = _post("198.51.100.21", user.username, PASSWORD)
    assert answer.status_code == 302 and "/console/login/verify" in answer["Location"]
    assert _post("198.51.100.20", "victim-next", "Winter2025!").status_code == 429


def test_every_refusal_is_the_same_page(settings, hashes):
    """Held back by the username's limit or by the source's: one page, one message (only the wait differs)."""
    settings.KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE = 2
    settings.KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE = 3
    for _ in range(2):
        _post("192.0.2.30", "alice", "guess")
    by_username = _post("192.0.2.31", "alice", "guess")
    for i in range(3):
        _post("192.0.2.32", f"user{i}", "guess")
    by_source = _post("192.0.2.32", "bob", "guess")
    assert by_username.status_code == by_source.status_code == 429

    def shape(answer) -> bytes:  # the wait and the per-client CSRF token aside
        page = re.sub(rb"wait \d+ s", b"wait N s", answer.content)
        return re.sub(rb'("X-CSRFToken": "|name="csrfmiddlewaretoken" value=")[^"]+', rb"\1T", page)

    assert shape(by_username) == shape(by_source)
    assert b"for this username" not in by_source.content


def test_successful_passwords_do_not_count_against_the_source(hashes):
    """An office behind one address: many people signing in is not an attack."""
    for _ in range(SOURCE_LIMIT + 5):
        user, _ = make_console_user(roles.READ_ONLY)
        assert _post("203.0.113.40", user.username, PASSWORD).status_code == 302
    assert _post("203.0.113.40", "typo", "pw").status_code == 400


def test_throttled_tries_are_recorded_once_a_minute(settings, hashes):
    settings.KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE = 2
    for i in range(2):
        _post("203.0.113.50", f"spray{i}", "pw")
    for i in range(10):
        assert _post("203.0.113.50", f"more{i}", "pw").status_code == 429
    assert _failed_steps() == ["password", "password", "throttled"]


def test_x_forwarded_for_counts_only_from_a_trusted_proxy(settings, hashes):
    settings.KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE = 3
    for i in range(3):  # a client rotating the header it sends itself stays one source
        _post("203.0.113.60", f"x{i}", "pw", HTTP_X_FORWARDED_FOR=f"10.1.1.{i}")
    assert _post("203.0.113.60", "x9", "pw", HTTP_X_FORWARDED_FOR="10.1.1.9").status_code == 429

    settings.KCAAS_TRUSTED_PROXIES = ["192.0.2.250"]
    for i in range(3):
        _post("192.0.2.250", f"y{i}", "pw", HTTP_X_FORWARDED_FOR="198.51.100.70")
    assert _post("192.0.2.250", "y9", "pw", HTTP_X_FORWARDED_FOR="198.51.100.70").status_code == 429
    assert _post("192.0.2.250", "y9", "pw", HTTP_X_FORWARDED_FOR="198.51.100.71").status_code == 400
