"""The SDK trusts node data planes through the platform CA the control plane publishes: it fetches
/.well-known/kcaas-ca.pem from the live server, and a TLS 1.3 server holding a node certificate issued by that CA
(gpu_node.agent.identity's data-plane context) verifies against it; a server with a certificate from another CA does
not."""

import socket
import ssl
import threading

import pytest
from django.db import transaction

from devtools import dev_pki
from fleet import pki
from fleet.models import Node
from fleet.services import node_create, node_register
from gpu_node.agent.identity import NodeIdentity
from kcaas import tls

pytestmark = pytest.mark.django_db(transaction=True)


def serve_once(server_ctx: ssl.SSLContext) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(sock, server_side=True) as conn:
                conn.sendall(b"hello")
        except (OSError, ssl.SSLError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def node_with_certificate() -> NodeIdentity:
    issued = node_create(name="tls-node")
    node_register(node_id=issued.node.pk, endpoint="127.0.0.1:7777", capacity={"device": 1 << 20, "dram": 0, "ssd": 0})
    identity = NodeIdentity()
    with transaction.atomic():
        cert, ca = pki.node_certificate_issue(
            node=Node.objects.select_for_update().get(pk=issued.node.pk), csr_pem=identity.csr_pem()
        )
    identity.install(cert, ca)
    return identity


def test_the_sdk_verifies_a_node_certificate_through_the_published_ca(live_server, tmp_path, settings):
    settings.KCAAS_DATA_PLANE_CA_FILE = ""  # the platform CA alone (a `make up` dev CA would follow it)
    ca_pem = tls.platform_ca_pem(live_server.url)
    assert ca_pem == pki.platform_ca_pem()
    client_ctx = tls.dataplane_ssl_context(ca_pem)
    assert client_ctx.minimum_version == ssl.TLSVersion.TLSv1_3

    listener, thread = serve_once(node_with_certificate().dataplane_server_context())
    with socket.create_connection(listener.getsockname()) as raw:
        with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            assert conn.version() == "TLSv1.3" and conn.recv(5) == b"hello"
    thread.join(5)
    listener.close()

    other = dev_pki.write_dev_pki(tmp_path, server_name="not the platform")  # a certificate from another CA
    foreign_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    foreign_ctx.load_cert_chain(other["cert"], other["key"])
    listener, thread = serve_once(foreign_ctx)
    with socket.create_connection(listener.getsockname()) as raw, pytest.raises(ssl.SSLCertVerificationError):
        client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    thread.join(5)
    listener.close()
