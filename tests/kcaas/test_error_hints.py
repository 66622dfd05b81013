"""Every connection error's hint names the endpoint that failed: a node's data-plane address when a node did not
answer (never "is the control plane running ... `make up`"), the control plane's URL when it did not."""

import socket
import ssl

import pytest

from kcaas import errors
from kcaas.dataplane import DataPlaneClient
from kcaas.dataplane_transport import DataPlaneError
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import SPEC, free_port


def _refusing_node(**where) -> DataPlaneError:
    client = DataPlaneClient(token="t", cache_id="c", identity=KVCacheSpec.from_dict(SPEC), timeout=5, **where)
    with pytest.raises(DataPlaneError) as caught:
        client.connect()
    return caught.value


def test_a_node_that_refuses_is_named_by_its_data_plane_address_not_the_control_plane():
    endpoint = f"127.0.0.1:{free_port()}"
    error = _refusing_node(endpoint=endpoint)
    assert error.code == "connection_error" and error.details["endpoint"] == endpoint
    assert endpoint in error.hint and "node" in error.hint
    assert "control plane running" not in error.hint and "make up" not in error.hint and "KCAAS_URL" not in error.hint


def test_a_node_socket_that_is_gone_is_named_by_its_path(tmp_path):
    path = str(tmp_path / "node.sock")
    error = _refusing_node(uds_path=path)
    assert path in error.hint and "make up" not in error.hint


def test_a_refusing_control_plane_is_named_by_its_url():
    url = f"http://127.0.0.1:{free_port()}"
    error = errors.APIConnectionError(f"Could not connect to {url}: [Errno 111] Connection refused")
    assert url in error.hint and "control plane" in error.hint and "make up" in error.hint


def test_an_untrusted_certificate_names_whose_it_is():
    message = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"
    node = errors.KcaasError(message, code="connection_error", details={"endpoint": "10.0.0.7:7400"})
    assert "the node at 10.0.0.7:7400" in node.hint
    plane = errors.APIConnectionError(f"https://kcaas.example: {message}", details={"url": "https://kcaas.example"})
    assert "the control plane at https://kcaas.example" in plane.hint and "node" not in plane.hint


def test_a_node_that_never_finishes_the_tls_handshake_is_named():
    with socket.socket() as listener:  # accepted by the kernel, never answered: a hung node
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        context = ssl.create_default_context()
        client = DataPlaneClient(endpoint, "t", "c", KVCacheSpec.from_dict(SPEC), ssl_context=context, timeout=2)
        with pytest.raises(DataPlaneError) as caught:
            client.connect()
    assert endpoint in caught.value.hint and "make up" not in caught.value.hint


def test_a_control_plane_that_cannot_give_its_ca_is_named_by_its_url():
    import kcaas

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(errors.APIConnectionError) as caught:
        kcaas.connect(url, "kc_live_nothing", retries=0).ssl_context()
    assert url in caught.value.hint and "control plane" in caught.value.hint


def test_a_taken_cache_name_says_which_cache_holds_it_and_the_ways_on():
    details = {"name": "chat", "cache_id": "8f0c2d4e-0000-4000-8000-000000000000", "state": "ready"}
    error = errors.ConflictError("A cache with this name is attached.", code="cache_name_taken", details=details)
    assert "a cache named chat already exists (cache_id 8f0c2d4e-0000-4000-8000-000000000000, state ready)" in (
        error.hint
    )
    assert "`kcaas show chat`" in error.hint and "`kcaas detach chat --wait`" in error.hint
    assert "another name" in error.hint
