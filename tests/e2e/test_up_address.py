"""Where `make up` listens (scripts/up.py api_address): KCAAS_URL's host and port when it is set, so the one
`export KCAAS_URL=...` serves make up, make demo and kcaas alike; else KCAAS_HOST / KCAAS_PORT; a KCAAS_URL that is
not http://HOST:PORT is refused with a message naming it, before anything starts."""

import importlib.util

import pytest

from tests.e2e.up_support import REPO


@pytest.fixture
def up():
    spec = importlib.util.spec_from_file_location("kcaas_up_script_address", REPO / "scripts" / "up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("KCAAS_URL", "KCAAS_HOST", "KCAAS_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_defaults_then_host_and_port(up, monkeypatch):
    assert up.api_address() == ("127.0.0.1", 8000)
    monkeypatch.setenv("KCAAS_HOST", "0.0.0.0")
    monkeypatch.setenv("KCAAS_PORT", "8100")
    assert up.api_address() == ("0.0.0.0", 8100)


@pytest.mark.parametrize(
    "url, address",
    [
        ("http://127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("http://localhost:8123/", ("localhost", 8123)),
        ("http://127.0.0.1", ("127.0.0.1", 80)),
    ],
)
def test_kcaas_url_wins_over_host_and_port(up, monkeypatch, url, address):
    monkeypatch.setenv("KCAAS_PORT", "8100")
    monkeypatch.setenv("KCAAS_URL", url)
    assert up.api_address() == address


@pytest.mark.parametrize(
    "url", ["https://127.0.0.1:9000", "127.0.0.1:9000", "http://127.0.0.1:99999", "http://h:1/api", "http://:9000"]
)
def test_a_kcaas_url_make_up_cannot_serve_is_refused_naming_it(up, monkeypatch, url):
    monkeypatch.setenv("KCAAS_URL", url)
    with pytest.raises(SystemExit) as refused:
        up.api_address()
    assert "KCAAS_URL" in str(refused.value) and url in str(refused.value)
