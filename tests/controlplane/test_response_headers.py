"""Response headers for deployments: API answers are never stored by a cache (`Cache-Control: no-store`; some carry
a secret shown once), and behind a TLS-terminating proxy the control plane sends HSTS and secure cookies, all set by
environment variables whose defaults suit `make up` (plain HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def staff(db) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("ops-headers", is_staff=True))
    return client


# ---- Cache-Control ---------------------------------------------------------------------------------------------------


def test_a_node_credential_is_answered_no_store(staff):
    """POST /api/v1/admin/nodes shows the node's credential once: no cache may keep it."""
    response = staff.post("/api/v1/admin/nodes", {"name": "headers-node"}, content_type="application/json")
    assert response.status_code == 201, response.content
    assert response.json()["credential"].startswith("kc_node_")
    assert response["Cache-Control"] == "no-store"


@pytest.mark.parametrize("path", ["/api/v1/admin/tenants", "/api/v1/admin/nodes", "/api/v1/whoami"])
def test_every_api_answer_is_no_store_errors_included(staff, path):
    assert staff.get(path)["Cache-Control"] == "no-store"
    assert Client().get(path)["Cache-Control"] == "no-store"  # a 401


def test_public_documents_keep_their_own_cache_policy(db):
    assert Client().get("/.well-known/jwks.json")["Cache-Control"] == "public, max-age=300"
    assert "Cache-Control" not in Client().get("/healthz")


# ---- TLS: proxy header, HSTS, cookies --------------------------------------------------------------------------------


def _settings_with(env: dict) -> dict:
    """The TLS settings a fresh process derives from `env` (settings are read once, at import)."""
    code = (
        "import json; from controlplane import settings as s; print(json.dumps({n: getattr(s, n) for n in ("
        "'SECURE_PROXY_SSL_HEADER', 'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS', 'SECURE_HSTS_PRELOAD',"
        "'SECURE_SSL_REDIRECT', 'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'CSRF_TRUSTED_ORIGINS')}))"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KCAAS_HSTS", "KCAAS_SECURE", "KCAAS_SSL", "KCAAS_CSRF"))
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_defaults_suit_plain_http_on_loopback():
    values = _settings_with({})
    assert values == {
        "SECURE_PROXY_SSL_HEADER": None,
        "SECURE_HSTS_SECONDS": 0,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": False,
        "SECURE_HSTS_PRELOAD": False,
        "SECURE_SSL_REDIRECT": False,
        "SESSION_COOKIE_SECURE": False,
        "CSRF_COOKIE_SECURE": False,
        "CSRF_TRUSTED_ORIGINS": [],
    }


def test_behind_tls_every_setting_comes_from_the_environment():
    values = _settings_with(
        {
            "KCAAS_SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto: https",
            "KCAAS_HSTS_SECONDS": "31536000",
            "KCAAS_HSTS_INCLUDE_SUBDOMAINS": "1",
            "KCAAS_HSTS_PRELOAD": "true",
            "KCAAS_SSL_REDIRECT": "1",
            "KCAAS_SECURE_COOKIES": "1",
            "KCAAS_CSRF_TRUSTED_ORIGINS": "https://kcaas.example.com, https://ops.example.com",
        }
    )
    assert values == {
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_SSL_REDIRECT": True,
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "CSRF_TRUSTED_ORIGINS": ["https://kcaas.example.com", "https://ops.example.com"],
    }


def test_a_malformed_proxy_header_setting_stops_the_start():
    code = "from controlplane import settings"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "KCAAS_SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto",
            "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
        },
    )
    assert done.returncode != 0 and "KCAAS_SECURE_PROXY_SSL_HEADER" in done.stderr


@pytest.fixture
def behind_tls(settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_HSTS_SECONDS = 31536000
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    settings.SECURE_HSTS_PRELOAD = True
    return settings


def test_hsts_on_answers_the_proxy_marks_https(db, behind_tls):
    response = Client().get("/api/v1/whoami", HTTP_X_FORWARDED_PROTO="https")
    assert response["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    assert "Strict-Transport-Security" not in Client().get("/api/v1/whoami")  # plain HTTP: never HSTS


def test_with_ssl_redirect_plain_http_is_redirected_but_the_health_check_is_not(db, behind_tls):
    behind_tls.SECURE_SSL_REDIRECT = True
    response = Client().get("/api/v1/whoami")
    assert response.status_code == 301 and response["Location"].startswith("https://")
    assert Client().get("/healthz").status_code == 200
    assert Client().get("/api/v1/whoami", HTTP_X_FORWARDED_PROTO="https").status_code == 401
