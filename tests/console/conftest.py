"""Console fixtures: staff users with console roles and enrolled authenticators, and Django test clients signed in
through the real two-step sign-in (password, then a TOTP code computed from the device's key)."""

from __future__ import annotations

import itertools

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django_otp.oath import TOTP

from console import roles
from console.models import ConsoleTOTPDevice as TOTPDevice

PASSWORD = "correct horse battery staple"
_names = itertools.count(1)


def totp_code(device: TOTPDevice) -> str:
    """The code the user's authenticator shows now for `device`."""
    totp = TOTP(device.bin_key, device.step, device.t0, device.digits, device.drift)
    return f"{totp.token():0{device.digits}d}"


def make_console_user(*role_names: str, username: str | None = None, enrolled: bool = True):
    user = get_user_model().objects.create_user(username or f"staff{next(_names)}", password=PASSWORD, is_staff=True)
    for role in role_names:
        user.groups.add(Group.objects.get_or_create(name=roles.group_name(role))[0])
    device = TOTPDevice.objects.create(user=user, name="console", confirmed=True) if enrolled else None
    return user, device


def sign_in(client: Client, user, device) -> Client:
    """Password then code, as a browser does; asserts the console answers the overview afterwards."""
    assert client.get("/console/login").status_code == 200
    token = {"csrfmiddlewaretoken": csrf_token(client)}
    answer = client.post("/console/login", {"username": user.get_username(), "password": PASSWORD, **token})
    assert answer.status_code == 302 and "/console/login/verify" in answer["Location"], answer
    device.refresh_from_db()
    device.last_t = -1  # a second sign-in within one 30 s step reuses the code, which django-otp refuses
    device.save(update_fields=["last_t"])
    answer = client.post("/console/login/verify", {"code": totp_code(device), **token})
    assert answer.status_code == 302, answer.content[:400]
    assert client.get("/console/").status_code == 200
    return client


def csrf_token(client: Client) -> str:
    """The CSRF token a page rendered for this client (the cookie's value is accepted as the form field)."""
    return client.cookies["csrftoken"].value


@pytest.fixture
def console_client(db):
    """console_client(*roles, csrf=False) -> a test client signed in as a new user holding `roles`; `.user` on it."""

    def make(*role_names: str, csrf: bool = False) -> Client:
        user, device = make_console_user(*role_names)
        client = Client(enforce_csrf_checks=csrf)
        sign_in(client, user, device)
        client.user = user
        return client

    return make


@pytest.fixture
def operator_client(console_client) -> Client:
    return console_client(roles.OPERATOR)


@pytest.fixture
def compliance_client(console_client) -> Client:
    return console_client(roles.COMPLIANCE)


@pytest.fixture
def readonly_client(console_client) -> Client:
    return console_client(roles.READ_ONLY)
