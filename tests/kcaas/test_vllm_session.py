"""The vLLM connector's set-up against the live control plane (kcaas.connectors.vllm_session): the cache found by id
or name, its layout checked against the engine's, and every problem one message that says what to fix — what vLLM
prints when it refuses to start. (The engine itself runs in tests/e2e/test_vllm_*.py, in vLLM's own venv.)"""

import dataclasses

import pytest

from kcaas.connectors.vllm_session import CacheSession, ConnectorConfig, ConnectorSetupError, EngineLayout
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import BLOCK_BYTES, SPEC

pytestmark = pytest.mark.django_db(transaction=True)

ENGINE = EngineLayout(
    model_fingerprint=SPEC["model_fingerprint"],
    num_layers=SPEC["num_layers"],
    num_kv_heads=SPEC["num_kv_heads"],
    head_dim=SPEC["head_dim"],
    kv_dtype=SPEC["kv_dtype"],
    block_size=4 * SPEC["block_size"],
)
KEY_ENV = "KCAAS_TEST_VLLM_KEY"


def config(url: str, cache: str, role: str = "kv_both", **extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra(
        {"kcaas_url": url, "cache": cache, "api_key_env": KEY_ENV, "ca_file": None, **extra}, role
    )


@pytest.fixture
def attached(make_tenant, node, sdk):
    tenant = make_tenant(scopes=("caches:read", "caches:write"))
    cache = sdk(tenant.raw_key).attach("chat", KVCacheSpec(**SPEC), {"device": 64 * BLOCK_BYTES}, timeout=20)
    return tenant, cache


def setup_error(url, cache, environ, engine=ENGINE, **extra) -> str:
    with pytest.raises(ConnectorSetupError) as refused:
        CacheSession(config(url, cache, **extra), engine, environ=environ)
    return str(refused.value)


def test_the_cache_is_found_by_name_or_id_and_a_consumer_gets_a_read_token(live_server, attached, monkeypatch):
    tenant, cache = attached
    environ = {KEY_ENV: tenant.raw_key}
    monkeypatch.setattr("kcaas.connectors.vllm_session.platform_ssl_context", lambda url: None)  # no TLS used here
    for wanted, role in ((cache.name, "kv_both"), (cache.id, "kv_consumer")):
        session = CacheSession(config(live_server.url, wanted, role), ENGINE, environ=environ)
        try:
            assert session.cache.id == cache.id and session.spec == cache.spec
            assert session.tokens.get().access == ("read" if role == "kv_consumer" else "readwrite")
            assert session.data_plane(timeout=1.0).read_only == (role == "kv_consumer")
        finally:
            session.close()


def test_each_set_up_problem_is_one_message_naming_it(live_server, attached):
    tenant, cache = attached
    url, environ = live_server.url, {KEY_ENV: tenant.raw_key}
    assert (
        setup_error(url, cache.name, {})
        == f"KCaaS connector: no API key: the environment variable {KEY_ENV} is not set"
    )
    assert "no cache 'nope' for this API key" in setup_error(url, "nope", environ)
    other_heads = dataclasses.replace(ENGINE, num_kv_heads=SPEC["num_kv_heads"] + 1)
    message = setup_error(url, cache.name, environ, engine=other_heads)
    assert "was attached for another KV layout" in message and "num_kv_heads" in message
    other_model = dataclasses.replace(ENGINE, model_fingerprint="other/model@main")
    assert "model_fingerprint" in setup_error(url, cache.name, environ, engine=other_model)
    odd_blocks = dataclasses.replace(ENGINE, block_size=SPEC["block_size"] * 3 + 1)
    assert "does not divide vLLM's block size" in setup_error(url, cache.name, environ, engine=odd_blocks)
    assert "refused" in setup_error(url, cache.name, {KEY_ENV: "kc_live_not-a-key"})


def test_configuration_errors_name_the_key():
    with pytest.raises(ConnectorSetupError, match="unknown kv_connector_extra_config keys \\['cahce'\\]"):
        ConnectorConfig.from_extra({"kcaas_url": "http://x", "cahce": "c"}, "kv_both")
    with pytest.raises(ConnectorSetupError, match="cache .* is required"):
        ConnectorConfig.from_extra({"kcaas_url": "http://x"}, "kv_both")
    with pytest.raises(ConnectorSetupError, match="kv_role must be one of"):
        ConnectorConfig.from_extra({"kcaas_url": "http://x", "cache": "c"}, None)
    with pytest.raises(ConnectorSetupError, match="no control-plane URL"):
        ConnectorConfig.from_extra({"cache": "c"}, "kv_both", environ={})
    with pytest.raises(ConnectorSetupError, match="wrong type"):
        ConnectorConfig.from_extra({"kcaas_url": "http://x", "cache": "c", "lookup_timeout_ms": "soon"}, "kv_both")
    producer = ConnectorConfig.from_extra({"kcaas_url": "http://x", "cache": "c"}, "kv_producer")
    consumer = ConnectorConfig.from_extra({"kcaas_url": "http://x", "cache": "c"}, "kv_consumer")
    assert (producer.save, producer.writes, producer.reads) == ("sync", True, False)
    assert (consumer.save, consumer.writes, consumer.reads) == ("async", False, True)
