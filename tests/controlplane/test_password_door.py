"""The REST API's password door (HTTP Basic for staff, controlplane.authentication): failed tries throttled per
account and per source BEFORE any password hash (429 `too_many_attempts`), successes not counted, one answer for
every refusal (unknown user, wrong password, inactive user, console user with the right password or not), and the
other tenants' API keys untouched — on the real PostgreSQL and Redis, and over real HTTP.

Hashes are counted by a real hasher configured in settings.PASSWORD_HASHERS (CountingHasher below), not by timing.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import MD5PasswordHasher
from django.contrib.auth.models import Group
from django.test import Client

from console import roles
from controlplane.authentication import failure_memo
from tenants import services as tenant_services
from tenants.ratelimit import Bucket, give_back, take_all

PASSWORD = "right horse battery staple"
URL = "/api/v1/admin/tenants"
ACCOUNT_LIMIT, SOURCE_LIMIT = 10, 30  # the defaults (settings.KCAAS_API_PASSWORD_FAILURES_*)


class CountingHasher(MD5PasswordHasher):
    """MD5 (fast) that counts every hash it computes: verify() and make_password() both go through encode()."""

    algorithm = "counting_md5"
    lock = threading.Lock()
    count = 0

    def encode(self, password, salt):
        with CountingHasher.lock:
            CountingHasher.count += 1
        return super().encode(password, salt)


@pytest.fixture
def hashes(settings, redis_client):
    """The counting hasher in use, an empty Redis and memo; returns a callable: hashes computed since the last reset."""
    settings.PASSWORD_HASHERS = [f"{__name__}.CountingHasher"]
    failure_memo.clear()

    class Counter:
        def reset(self):
            CountingHasher.count = 0

        def __call__(self) -> int:
            return CountingHasher.count

    counter = Counter()
    counter.reset()
    yield counter
    failure_memo.clear()


_names = iter(range(1, 10**9))


def make_user(*role_names: str, username: str | None = None, active: bool = True, superuser: bool = False):
    model = get_user_model()
    name = username or f"door{next(_names)}-{time.monotonic_ns()}"
    user = model.objects.create_user(name, password=PASSWORD, is_staff=True, is_active=active, is_superuser=superuser)
    for role in role_names:
        user.groups.add(Group.objects.get_or_create(name=roles.group_name(role))[0])
    return user


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def call(username: str, password: str, *, source: str = "198.51.100.7", **extra):
    return Client(REMOTE_ADDR=source).get(URL, HTTP_AUTHORIZATION=basic(username, password), **extra)


def assert_throttled(response) -> int:
    assert response.status_code == 429, response.content
    body = response.json()
    assert set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == "too_many_attempts"
    wait = body["error"]["details"]["retry_after_seconds"]
    assert isinstance(wait, int) and wait >= 1 and response["Retry-After"] == str(wait)
    return wait


pytestmark = pytest.mark.django_db


def test_failures_per_account_are_throttled_before_any_hash(hashes):
    user = make_user()
    hashes.reset()
    for i in range(ACCOUNT_LIMIT):  # distinct wrong passwords: each a new guess, each one hash
        assert call(user.username, f"guess {i}", source=f"198.51.100.{i + 1}").status_code == 401
    assert hashes() == ACCOUNT_LIMIT
    refused = [call(user.username, f"more {i}", source="192.0.2.200") for i in range(20)]
    for response in refused:
        assert_throttled(response)
    assert call(user.username, PASSWORD, source="192.0.2.201").status_code == 429  # held, whatever the password
    assert hashes() == ACCOUNT_LIMIT  # not one hash for the 21 refused tries
    # Another account from the same sources is not held back by this one.
    other = make_user()
    assert call(other.username, PASSWORD, source="192.0.2.200").status_code == 200


def test_failures_per_source_are_throttled_before_any_hash(hashes):
    user = make_user()
    hashes.reset()
    for i in range(SOURCE_LIMIT):  # one password sprayed over many (unknown) usernames from one address
        assert call(f"nobody{i}", "Summer2025!", source="203.0.113.9").status_code == 401
    assert hashes() == SOURCE_LIMIT  # ModelBackend hashes a dummy for unknown users: the same work
    assert_throttled(call(user.username, PASSWORD, source="203.0.113.9"))
    assert_throttled(call("nobody-else", "Summer2025!", source="203.0.113.9"))
    assert hashes() == SOURCE_LIMIT
    assert call(user.username, PASSWORD, source="203.0.113.10").status_code == 200  # another address is let in


def test_successful_sign_ins_are_not_counted(hashes):
    user = make_user()
    for _ in range(3 * SOURCE_LIMIT):
        assert call(user.username, PASSWORD, source="198.51.100.50").status_code == 200
    for i in range(ACCOUNT_LIMIT):  # the account's and the source's whole allowance of failures is still there
        assert call(user.username, f"typo {i}", source="198.51.100.50").status_code == 401
    assert call(user.username, PASSWORD, source="198.51.100.50").status_code == 429


def test_every_refusal_is_the_same_answer_after_the_same_work(hashes):
    staff, inactive = make_user(), make_user(active=False)
    console_user = make_user(roles.OPERATOR)
    cases = {
        "unknown user": ("no-such-user", PASSWORD),
        "impossible user (NUL)": ("no\x00user", PASSWORD),
        "wrong password": (staff.username, "wrong"),
        "inactive user": (inactive.username, PASSWORD),
        "console user, right password": (console_user.username, PASSWORD),
        "console user, wrong password": (console_user.username, "wrong"),
    }
    answers = {}
    for case, (username, password) in cases.items():
        hashes.reset()
        answers[case] = call(username, password, source="198.51.100.60")
        assert hashes() == 1, case  # one hash each: no refusal is cheaper (or dearer) than another
    first = answers["unknown user"]
    assert first.status_code == 401 and first.json()["error"]["code"] == "authentication_failed"
    for case, response in answers.items():
        assert (response.status_code, response.content, response["WWW-Authenticate"]) == (
            first.status_code,
            first.content,
            first["WWW-Authenticate"],
        ), case
    # A superuser holding console roles keeps the API (as before), and so does plain staff.
    assert call(make_user(roles.OPERATOR, superuser=True).username, PASSWORD).status_code == 200
    assert call(staff.username, PASSWORD).status_code == 200


def test_no_password_oracle_for_console_users_around_their_throttle(hashes):
    """Right and wrong passwords of a console user answer byte for byte alike, and are throttled alike."""
    console_user = make_user(roles.COMPLIANCE)
    right = call(console_user.username, PASSWORD)
    wrong = call(console_user.username, "not it")
    assert right.status_code == wrong.status_code == 401 and right.content == wrong.content
    # Repeated (the memo holds both): alike again, without a hash.
    hashes.reset()
    assert call(console_user.username, PASSWORD).content == call(console_user.username, "not it").content
    assert hashes() == 0

    held = make_user(roles.OPERATOR)
    for i in range(ACCOUNT_LIMIT):
        assert call(held.username, f"guess {i}").content == wrong.content
    throttled_right = call(held.username, PASSWORD, source="192.0.2.77")
    throttled_wrong = call(held.username, "still not it", source="192.0.2.77")
    assert_throttled(throttled_right) and assert_throttled(throttled_wrong)

    def without_wait(response) -> dict:
        body = response.json()
        del body["error"]["details"]["retry_after_seconds"]
        return body

    assert without_wait(throttled_right) == without_wait(throttled_wrong)


def test_a_repeated_refused_credential_costs_no_hash_and_no_try(hashes):
    """A script retrying a stale password neither burns CPU nor locks its account out; the account's real guesses
    are still counted, and a password change takes effect at once."""
    user = make_user()
    hashes.reset()
    for _ in range(5 * ACCOUNT_LIMIT):
        assert call(user.username, "old password").status_code == 401
    assert hashes() == 1
    assert call(user.username, PASSWORD).status_code == 200  # not locked out
    user.set_password("old password")
    user.save()
    hashes.reset()
    assert call(user.username, "old password").status_code == 200  # the new password works at once
    assert hashes() == 1


def test_the_throttle_names_no_username_or_address_in_redis(hashes, redis_client):
    name = f"secret-admin-{time.monotonic_ns()}"
    for i in range(ACCOUNT_LIMIT + 1):
        call(name, f"guess {i}", source="192.0.2.123")
    keys = b" ".join(redis_client.keys("*"))
    assert keys and name.encode() not in keys and b"192.0.2.123" not in keys


def test_x_forwarded_for_is_trusted_only_from_the_configured_proxies(hashes, settings):
    """Rotating X-Forwarded-For does not escape the source limit unless the peer is a trusted proxy; behind one,
    each client behind it has its own limit."""
    for i in range(SOURCE_LIMIT):
        call(f"spray{i}", "pw", source="198.51.100.99", HTTP_X_FORWARDED_FOR=f"10.0.{i}.1")
    assert_throttled(call("spray-x", "pw", source="198.51.100.99", HTTP_X_FORWARDED_FOR="10.9.9.9"))

    settings.KCAAS_TRUSTED_PROXIES = ["192.0.2.0/24"]
    for i in range(SOURCE_LIMIT):
        call(f"behind{i}", "pw", source="192.0.2.1", HTTP_X_FORWARDED_FOR=f"1.2.3.4, 203.0.113.{i % 2 + 1}")
    # 203.0.113.1 and .2 had 15 failures each: both still under the limit, and the proxy itself is not held.
    assert call("behind-x", "pw", source="192.0.2.1", HTTP_X_FORWARDED_FOR="203.0.113.1").status_code == 401
    for i in range(SOURCE_LIMIT):
        call(f"behind-more{i}", "pw", source="192.0.2.1", HTTP_X_FORWARDED_FOR="203.0.113.1")
    assert_throttled(call("behind-y", "pw", source="192.0.2.1", HTTP_X_FORWARDED_FOR="203.0.113.1"))
    user = make_user()
    assert call(user.username, PASSWORD, source="192.0.2.1", HTTP_X_FORWARDED_FOR="203.0.113.2").status_code == 200


def test_an_ipv6_source_is_counted_by_its_64(hashes):
    for i in range(SOURCE_LIMIT):
        call(f"v6-{i}", "pw", source=f"2001:db8:1:2::{i + 1:x}")
    assert_throttled(call("v6-x", "pw", source="2001:db8:1:2:ffff::1"))
    assert call("v6-y", "pw", source="2001:db8:1:3::1").status_code == 401


@pytest.mark.django_db(transaction=True)
def test_over_http_an_attack_is_throttled_and_other_tenants_keys_are_not(hashes, live_server, settings):
    """Eight clients of wrong passwords against one staff account over real HTTP (through a trusted proxy, each
    client its own X-Forwarded-For): the door computes at most the account's allowance of hashes and answers the
    rest 429 with Retry-After, while another tenant's API key is served throughout (its requests never meet the
    password door or its limits)."""
    settings.KCAAS_TRUSTED_PROXIES = ["127.0.0.1"]
    staff = make_user()
    tenant = tenant_services.tenant_create(name=f"bystander-{time.monotonic_ns()}")
    key = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read"]).raw_key
    hashes.reset()
    statuses: list[int] = []
    retry_after: list[str] = []
    lock = threading.Lock()
    started = time.monotonic()

    def attacker(n: int):
        for i in range(15):
            request = urllib.request.Request(
                live_server.url + URL,
                headers={
                    "Authorization": basic(staff.username, f"guess {n}-{i}"),
                    "X-Forwarded-For": f"203.0.113.{n + 1}",
                },
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    status = answer.status
            except urllib.error.HTTPError as error:
                status = error.code
                if status == 429:
                    body = json.loads(error.read())
                    assert body["error"]["code"] == "too_many_attempts"
                    with lock:
                        retry_after.append(error.headers["Retry-After"])
            with lock:
                statuses.append(status)

    def bystander(results: list[int]):
        for _ in range(20):
            request = urllib.request.Request(
                live_server.url + "/api/v1/whoami", headers={"Authorization": f"Bearer {key}"}
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                results.append(answer.status)

    served: list[int] = []
    threads = [threading.Thread(target=attacker, args=(n,)) for n in range(8)]
    threads.append(threading.Thread(target=bystander, args=(served,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    elapsed = time.monotonic() - started
    assert len(statuses) == 8 * 15 and set(statuses) <= {401, 429}
    allowance = ACCOUNT_LIMIT + int(elapsed / (60 / ACCOUNT_LIMIT)) + 1  # the burst, plus what refilled meanwhile
    assert statuses.count(401) <= allowance and hashes() <= allowance
    assert statuses.count(429) >= 8 * 15 - allowance and all(int(v) >= 1 for v in retry_after)
    assert served == [200] * 20


@pytest.mark.parametrize("redis_url", ["redis", ""])
def test_take_all_is_all_or_none_and_give_back_returns_the_cells(redis_url, settings, redis_client):
    """The machinery under both doors (tenants.ratelimit), in Redis and in process (the embedded default)."""
    if not redis_url:
        settings.REDIS_URL = ""
    suffix = f"{redis_url or 'local'}-{time.monotonic_ns()}"
    tight, loose = Bucket(f"t-tight-{suffix}", 1 / 3600, 1), Bucket(f"t-loose-{suffix}", 1 / 3600, 3)
    assert take_all([tight, loose]).allowed
    refused = take_all([tight, loose])
    assert not refused.allowed and refused.refused_by == tight and refused.decision.retry_after_seconds > 3000
    assert take_all([loose]).allowed and take_all([loose]).allowed  # the refusal took nothing from `loose`
    assert not take_all([loose]).allowed
    give_back([tight, loose])
    assert take_all([tight, loose]).allowed  # both cells came back
    give_back([tight])
    give_back([tight])  # more than was taken: never below "idle"
    assert take_all([tight]).allowed and not take_all([tight]).allowed
