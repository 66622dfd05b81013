"""kcaas.connect() against the real service: the control plane (pytest-django's live server on PostgreSQL), the control
queue's Celery worker and a node agent PROCESS serving TLS 1.3 with a certificate from a throwaway CA (tests/e2e's
fixtures). The CA reaches the SDK the way it does under `make up`: the control plane publishes it after the platform
CA at /.well-known/kcaas-ca.pem (settings.KCAAS_DATA_PLANE_CA_FILE), or the engine pins it with ca=."""

from __future__ import annotations

import pytest
import torch
from django.test import Client as DjangoClient

import kcaas
from fleet import pki as fleet_pki
from kcaas import errors
from kcaas.dataplane import DataPlaneError
from tests.caches.conftest import free_port
from tests.e2e.conftest import (  # noqa: F401 - fixtures reused
    agent,
    agent_launcher,
    control_worker,
    model,
    pki,
    random_kv,
    random_tokens,
    spec_for,
    tenant_key,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def published_ca(settings, pki):
    """The agents' CA published by the live control plane, as `make up` publishes its dev CA."""
    settings.KCAAS_DATA_PLANE_CA_FILE = pki["ca"]
    return pki["ca"]


def test_connect_cache_put_get_and_a_read_only_cache_client(live_server, agent, published_ca, model):
    spec = spec_for(model)
    with kcaas.connect(live_server.url, tenant_key()) as kc:
        cache = kc.client.attach("chat", spec, {"device": 64 * spec.block_bytes}, timeout=30)
        writer = kc.cache("chat", access="readwrite")
        assert writer.hello is not None and not writer.read_only  # connected (HELLO answered) before any request
        tokens, kv = random_tokens(40, seed=1)[0], random_kv(spec, 40, seed=1)
        assert writer.put(tokens, kv)["num_cached"] == 40
        assert writer.lookup(tokens) == 40

        reader = kc.cache(cache.id)  # by id; "read" is the default access, as for the REST API's data tokens
        assert reader.read_only
        n, got = reader.get(tokens)
        assert n == 40 and torch.equal(got, kv)
        with pytest.raises(DataPlaneError) as refused:
            reader.put(random_tokens(16, seed=2)[0], random_kv(spec, 16, seed=2))
        assert refused.value.code == "forbidden"


def test_url_and_key_default_to_the_environment(live_server, monkeypatch):
    monkeypatch.setenv("KCAAS_URL", live_server.url)
    monkeypatch.setenv("KCAAS_API_KEY", tenant_key())
    with kcaas.connect() as kc:
        assert kc.url == live_server.url and kc.client.whoami().tenant_id


def test_an_untrusted_node_certificate_says_to_pass_ca(live_server, agent, settings, pki, model):
    settings.KCAAS_DATA_PLANE_CA_FILE = ""  # only the platform CA is published: it did not sign the agent's cert
    spec = spec_for(model)
    key = tenant_key()
    with kcaas.connect(live_server.url, key) as kc:
        kc.client.attach("chat", spec, {"device": 64 * spec.block_bytes}, timeout=30)
        with pytest.raises(kcaas.CertificateVerifyError) as caught:
            kc.cache("chat")
    text = str(caught.value)
    assert "CERTIFICATE_VERIFY_FAILED" in text and "ca=" in text and "/.well-known/kcaas-ca.pem" in text

    with kcaas.connect(live_server.url, key, ca=pki["ca"]) as pinned:  # ca= as a path ...
        assert pinned.cache("chat").lookup(random_tokens(16, seed=3)[0]) == 0
    with kcaas.connect(live_server.url, key, ca=open(pki["ca"]).read()) as pinned:  # ... or as PEM text
        assert pinned.cache("chat").hello is not None
    with kcaas.connect(live_server.url, key, verify=False) as unchecked:  # a local experiment: no certificate check
        assert unchecked.cache("chat").hello is not None


def test_the_published_ca_is_the_platform_ca_then_the_data_plane_ca(settings, tmp_path, pki):
    settings.KCAAS_DATA_PLANE_CA_FILE = pki["ca"]
    response = DjangoClient().get("/.well-known/kcaas-ca.pem")  # no credentials
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-pem-file"
    assert response["Cache-Control"].startswith("public")
    platform_ca, data_plane_ca = fleet_pki.platform_ca_pem(), open(pki["ca"]).read()
    assert response.content.decode() == platform_ca.rstrip("\n") + "\n" + data_plane_ca.strip() + "\n"

    for unusable in (str(tmp_path / "missing.pem"), ""):
        settings.KCAAS_DATA_PLANE_CA_FILE = unusable
        assert DjangoClient().get("/.well-known/kcaas-ca.pem").content.decode() == platform_ca
    not_a_certificate = tmp_path / "key.pem"
    not_a_certificate.write_text(open(pki["key"]).read())  # a private key put there by mistake is never served
    settings.KCAAS_DATA_PLANE_CA_FILE = str(not_a_certificate)
    assert DjangoClient().get("/.well-known/kcaas-ca.pem").content.decode() == platform_ca


def test_errors_carry_code_details_and_a_hint(live_server, agent, published_ca, model):
    refused_url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(errors.APIConnectionError) as caught:
        kcaas.connect(refused_url, "kc_live_nothing", retries=0).client.whoami()
    assert "make up" in caught.value.hint and refused_url in caught.value.hint and "KCAAS_URL" in str(caught.value)

    with pytest.raises(errors.AuthenticationError) as caught:
        kcaas.connect(live_server.url, "kc_live_not-a-real-key").client.whoami()
    assert "KCAAS_API_KEY" in caught.value.hint and "-- hint:" in str(caught.value)

    spec = spec_for(model)
    with kcaas.connect(live_server.url, tenant_key()) as kc:
        with pytest.raises(errors.ServiceUnavailableError) as caught:
            kc.client.attach("huge", spec, {"device": 1 << 30}, timeout=30)  # within quota, beyond the node
        error = caught.value
        assert error.code == "no_capacity" and error.details["largest_free"]["device"] > 0
        assert str(error.details["largest_free"]) in error.hint and "KCAAS_NODE_DEVICE_BYTES" in error.hint
        assert "largest_free" in str(error)  # the details are part of the message

        with pytest.raises(errors.NotFoundError) as caught:
            kc.cache("no-such-cache")
        assert caught.value.code == "cache_not_found" and "attach" in caught.value.hint


def test_no_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("KCAAS_API_KEY", raising=False)
    with pytest.raises(errors.KcaasError) as caught:
        kcaas.connect("http://127.0.0.1:1")
    assert caught.value.code == "not_authenticated" and "KCAAS_API_KEY" in str(caught.value)
