"""The node agent as a real process holds a platform-issued identity: it registers with a CSR (its key generated and
kept on the node, persisted 0600 in KCAAS_NODE_IDENTITY_DIR), the control plane records the certificate it issued,
and with KCAAS_NODE_TLS_FROM_IDENTITY its TLS data plane presents that certificate, which a client verifies with
the platform CA and the endpoint's IP."""

import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from fleet import pki
from fleet import services as fleet_services
from fleet.models import Node
from tests.caches.conftest import BLOCK_BYTES, free_port, purge_node_queue

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def agent_with_identity(live_server, tmp_path):
    issued = fleet_services.node_create(name="agent-with-identity")
    endpoint = f"127.0.0.1:{free_port()}"
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "KCAAS_CONTROL_URL": live_server.url,
        "KCAAS_NODE_CREDENTIAL": issued.credential,
        "KCAAS_NODE_ENDPOINT": endpoint,
        "KCAAS_NODE_DEVICE_BYTES": str(16 * BLOCK_BYTES),
        "KCAAS_NODE_TORCH_DEVICE": "cpu",
        "KCAAS_NODE_IDENTITY_DIR": str(tmp_path / "identity"),
        "KCAAS_NODE_TLS_FROM_IDENTITY": "1",
        "LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gpu_node.agent"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        if "ready" not in line:
            process.kill()
            pytest.fail(f"agent did not start: {line!r} {process.stderr.read()[-3000:]}")
        yield process, issued.node.pk, endpoint, tmp_path / "identity"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        purge_node_queue(issued.node.pk)


def test_the_agent_registers_with_a_csr_and_serves_its_platform_certificate(agent_with_identity):
    process, node_id, endpoint, identity_dir = agent_with_identity
    node = Node.objects.get(pk=node_id)
    saved = x509.load_pem_x509_certificate((identity_dir / "node.pem").read_bytes())
    assert node.certificate_serial == format(saved.serial_number, "x")
    assert node.certificate_not_after == saved.not_valid_after_utc
    saved.verify_directly_issued_by(pki.platform_ca()[1])
    assert stat.S_IMODE((identity_dir / "node.key").stat().st_mode) == 0o600

    client = ssl.create_default_context(cadata=pki.platform_ca_pem())  # host-name check on: the endpoint IP SAN
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        with client.wrap_socket(sock, server_hostname=host) as conn:
            served = x509.load_der_x509_certificate(conn.getpeercert(binary_form=True))
            assert conn.version() == "TLSv1.3"
    assert served.serial_number == saved.serial_number
    assert served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    ) == [f"spiffe://kcaas/node/{node_id}"]

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
