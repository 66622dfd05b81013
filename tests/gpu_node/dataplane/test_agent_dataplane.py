"""The agent's data-plane step: built from AgentConfig (TLS files, listen address, UDS) and the control plane's JWKS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_node.agent.process import AgentConfig, NodeAgent
from kcaas.dataplane import DataPlaneClient, DataPlaneError
from tests.gpu_node.dataplane.conftest import CACHE_A, NODE_ID
from tests.gpu_node.kv_fixtures import prefix_kv


class FakeControl:
    def __init__(self, jwks):
        self._jwks = jwks

    def jwks(self):
        return self._jwks


def test_agent_starts_and_stops_the_data_plane(pki, jwks, registry, make_token, client_ctx, spec, tmp_path):
    config = AgentConfig(
        control_url="http://unused",
        credential="x",
        broker_url="memory://",
        endpoint="127.0.0.1:0",
        device_capacity_bytes=1 << 20,
        tls_cert_file=pki["cert"],
        tls_key_file=pki["key"],
        uds_path=str(tmp_path / "agent.sock"),
    )
    agent = NodeAgent(config, control=FakeControl(jwks))
    agent.registry, agent.node_id = registry, NODE_ID  # what start() sets before this step
    agent._start_dataplane()
    try:
        toks = np.arange(40, dtype=np.int32)
        kv = prefix_kv(spec, toks)
        with DataPlaneClient(agent.dataplane.endpoint, make_token(), CACHE_A, spec, ssl_context=client_ctx) as dp:
            dp.put(toks, kv)
        with DataPlaneClient(None, make_token(), CACHE_A, spec, uds_path=config.uds_path) as dp:
            n, got = dp.get(toks)
            assert n == 40 and torch.equal(got, kv)
    finally:
        agent.stop()
    assert agent.dataplane.connection_count() == 0


def test_agent_without_tls_or_uds_runs_no_data_plane(jwks):
    config = AgentConfig(
        control_url="http://unused",
        credential="x",
        broker_url="memory://",
        endpoint="127.0.0.1:0",
        device_capacity_bytes=1 << 20,
    )
    agent = NodeAgent(config, control=FakeControl(jwks))
    agent._start_dataplane()
    assert agent.dataplane is None


def test_data_plane_metrics(registry, verifier, pki, make_token, client_ctx, spec):
    from gpu_node.agent.metrics import NodeMetrics
    from gpu_node.dataplane.server import DataPlaneServer, server_tls_context

    metrics = NodeMetrics(registry)
    srv = DataPlaneServer(
        registry, NODE_ID, verifier, server_tls_context(pki["cert"], pki["key"]), "127.0.0.1", 0, metrics=metrics
    ).start()
    try:
        toks = np.arange(12, dtype=np.int32)
        with DataPlaneClient(srv.endpoint, make_token(), CACHE_A, spec, ssl_context=client_ctx) as dp:
            dp.put(toks, prefix_kv(spec, toks))
            dp.get(toks)
        with pytest.raises(DataPlaneError):  # an expired token: refused, and counted below
            DataPlaneClient(srv.endpoint, make_token(exp=1), CACHE_A, spec, ssl_context=client_ctx).lookup(toks)
    finally:
        srv.stop()
    value = metrics.registry.get_sample_value
    assert value("kcaas_dataplane_tls_handshakes_total", {"outcome": "ok"}) == 2
    assert value("kcaas_dataplane_request_seconds_count", {"op": "put"}) == 1
    assert value("kcaas_dataplane_request_seconds_count", {"op": "get"}) == 1
    assert value("kcaas_dataplane_auth_failures_total", {"reason": "token_expired"}) == 1


class RevokingControl(FakeControl):
    """Answers heartbeats the way the control plane does once a token was revoked (fleet's revoked_tokens)."""

    def __init__(self, jwks, revoked: list[dict]):
        super().__init__(jwks)
        self.revoked = revoked

    def heartbeat(self, *, capacity, resident):
        return {"state": "ready", "revoked_tokens": self.revoked}


def test_a_heartbeat_answer_revokes_tokens_on_open_connections(pki, jwks, registry, make_token, client_ctx, spec):
    import time
    import uuid

    import pytest

    from kcaas.dataplane import DataPlaneError

    jti = str(uuid.uuid4())
    control = RevokingControl(jwks, [{"jti": jti, "exp": int(time.time()) + 300}])
    config = AgentConfig(
        control_url="http://unused",
        credential="x",
        broker_url="memory://",
        endpoint="127.0.0.1:0",
        device_capacity_bytes=1 << 20,
        tls_cert_file=pki["cert"],
        tls_key_file=pki["key"],
    )
    agent = NodeAgent(config, control=control)
    agent.registry, agent.node_id = registry, NODE_ID
    agent._start_dataplane()
    try:
        toks = np.arange(8, dtype=np.int32)
        with DataPlaneClient(
            agent.dataplane.endpoint, make_token(jti=jti), CACHE_A, spec, ssl_context=client_ctx
        ) as dp:
            assert dp.lookup(toks) == 0  # authenticated
            agent.send_heartbeat()
            with pytest.raises(DataPlaneError) as refused:
                dp.lookup(toks)  # the same open connection
            assert refused.value.code == "unauthenticated" and "revoked" in str(refused.value)
        with DataPlaneClient(agent.dataplane.endpoint, make_token(), CACHE_A, spec, ssl_context=client_ctx) as dp:
            assert dp.lookup(toks) == 0  # other tokens still work
    finally:
        agent.stop()
