"""Mutual TLS between nodes with certificates from the real platform CA (fleet.pki) over loopback sockets:
gpu_node.agent.identity's contexts, peer_node_id and expect_peer; what is refused; renewal through the live REST API."""

import datetime as dt
import socket
import ssl
import threading

import pytest
from django.db import transaction

from devtools import dev_pki
from fleet import pki
from fleet.models import Node
from gpu_node.agent.identity import (
    IdentityError,
    NodeIdentity,
    PeerIdentityError,
    RenewalLoop,
    expect_peer,
    peer_node_id,
)
from gpu_node.agent.process import ControlPlane

TIMEOUT = 5.0


def _issue(node: Node, identity: NodeIdentity, *, now=None, install=True) -> tuple[str, str]:
    with transaction.atomic():
        cert, ca = pki.node_certificate_issue(
            node=Node.objects.select_for_update().get(pk=node.pk), csr_pem=identity.csr_pem(), now=now
        )
    if install:
        identity.install(cert, ca)
    return cert, ca


@pytest.fixture
def node_identity(make_node):
    """node_identity(name) -> (node id, NodeIdentity holding a fresh platform certificate)."""

    def make(name):
        handle = make_node(name)
        identity = NodeIdentity()
        _issue(handle.node, identity)
        return str(handle.node.pk), identity

    return make


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, *, expect=None):
    """One connection over loopback: (server outcome, client outcome); an outcome is the peer node id (or, for the
    client, the bytes the server sent) or the exception raised."""
    listener = socket.create_server(("127.0.0.1", 0))
    outcome = {}

    def serve():
        sock, _ = listener.accept()
        sock.settimeout(TIMEOUT)
        try:
            with server_ctx.wrap_socket(sock, server_side=True) as conn:
                outcome["server"] = peer_node_id(conn)
                conn.sendall(b"ok")
        except Exception as error:  # noqa: BLE001 - the outcome under test
            outcome["server"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=TIMEOUT) as sock:
            with client_ctx.wrap_socket(sock) as conn:
                if expect is not None:
                    expect_peer(conn, expect)
                outcome["client"] = (peer_node_id(conn), conn.recv(2), conn.version())
    except Exception as error:  # noqa: BLE001
        outcome["client"] = error
    thread.join(TIMEOUT)
    listener.close()
    return outcome["server"], outcome["client"]


def test_mutual_tls_names_both_nodes(node_identity):
    a_id, a = node_identity("a")
    b_id, b = node_identity("b")
    server, client = _handshake(a.server_context(), b.client_context(), expect=a_id)
    assert server == b_id
    assert client == (a_id, b"ok", "TLSv1.3")


def test_expect_peer_refuses_another_node(node_identity):
    a_id, a = node_identity("a")
    b_id, b = node_identity("b")
    c_id, _ = node_identity("c")
    _, client = _handshake(a.server_context(), b.client_context(), expect=c_id)
    assert isinstance(client, PeerIdentityError) and a_id in str(client)


def test_a_certificate_from_another_ca_is_refused_both_ways(node_identity):
    a_id, a = node_identity("a")
    rogue_ca_key, rogue_ca = dev_pki.new_ca("rogue", valid_for=dt.timedelta(hours=1))
    rogue = NodeIdentity()
    rogue_cert = _sign_like_the_platform(rogue, rogue_ca_key, rogue_ca, node_id=a_id)
    rogue.install(dev_pki.pem_cert(rogue_cert), dev_pki.pem_cert(rogue_ca))
    server, client = _handshake(a.server_context(), rogue.client_context())
    assert isinstance(server, ssl.SSLError)  # the server refuses the rogue client certificate
    server, client = _handshake(rogue.server_context(), a.client_context())
    assert isinstance(client, ssl.SSLCertVerificationError)  # the client refuses the rogue server


def _sign_like_the_platform(identity, ca_key, ca_cert, *, node_id):
    """A certificate shaped exactly like fleet.pki's (same SANs and EKUs), signed by another CA."""
    from cryptography import x509

    node = Node(pk=node_id, endpoint="127.0.0.1:7000")
    csr = x509.load_pem_x509_csr(identity.csr_pem())
    now = dt.datetime.now(dt.UTC)
    return pki._node_certificate(
        node, csr.public_key(), ca_key, ca_cert, not_before=now - pki.BACKDATE, not_after=now + dt.timedelta(hours=1)
    )


def test_an_expired_certificate_is_refused(node_identity, make_node):
    a_id, a = node_identity("a")
    stale = NodeIdentity()
    _issue(make_node("stale").node, stale, now=dt.datetime.now(dt.UTC) - dt.timedelta(hours=13))
    assert stale.not_valid_after < dt.datetime.now(dt.UTC)
    server, _ = _handshake(a.server_context(), stale.client_context())
    assert isinstance(server, ssl.SSLError) and "expired" in str(server)
    _, client = _handshake(stale.server_context(), a.client_context())
    assert isinstance(client, ssl.SSLCertVerificationError) and "expired" in str(client)


def test_a_client_without_certificate_is_refused(node_identity):
    _, a = node_identity("a")
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cadata=a.ca_pem.decode())
    server, _ = _handshake(a.server_context(), bare)
    assert isinstance(server, ssl.SSLError) and "certificate" in str(server).lower()


def test_a_tls_1_2_client_is_refused(node_identity):
    _, a = node_identity("a")
    _, b = node_identity("b")
    old = b.client_context()
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_2
    server, client = _handshake(a.server_context(), old)
    assert isinstance(server, ssl.SSLError) and isinstance(client, ssl.SSLError)


def test_install_refuses_a_certificate_for_another_key_or_node(node_identity, make_node):
    _, a = node_identity("a")
    other_node = make_node("other").node
    cert, ca = _issue(other_node, NodeIdentity(), install=False)
    with pytest.raises(IdentityError, match="not for this node's key"):
        NodeIdentity().install(cert, ca)
    cert_for_a_key = _issue(other_node, a, install=False)  # a's key, but naming another node
    with pytest.raises(IdentityError, match="names node"):
        a.install(*cert_for_a_key)


@pytest.mark.django_db(transaction=True)
def test_renewal_through_the_live_rest_api_rotates_the_key_and_keeps_listeners_serving(live_server, make_node):
    handle = make_node("renewing")
    control = ControlPlane(live_server.url, handle.credential)
    identity = NodeIdentity()
    first = control.register(
        endpoint="127.0.0.1:7444", capacity={"device": 1, "dram": 0, "ssd": 0}, csr=identity.csr_pem().decode()
    )
    identity.install(first["certificate"], first["ca_certificate"])
    listener_ctx = identity.server_context()  # handed out before the renewal
    old_serial = Node.objects.get(pk=handle.node.pk).certificate_serial
    old_pem = identity.certificate_pem

    loop = RenewalLoop(
        identity, send=control.certificate, clock=lambda: dt.datetime.now(dt.UTC) + dt.timedelta(hours=7)
    )
    assert loop.seconds_until_due() == 0  # past half-life on that clock
    assert loop.tick() is True
    assert identity.certificate_pem != old_pem
    assert Node.objects.get(pk=handle.node.pk).certificate_serial not in ("", old_serial)

    peer = NodeIdentity()
    peer_node = make_node("peer")
    _issue(peer_node.node, peer)
    server, client = _handshake(listener_ctx, peer.client_context(), expect=str(handle.node.pk))
    assert server == str(peer_node.node.pk) and client[1] == b"ok"


@pytest.mark.django_db(transaction=True)
def test_renewal_with_a_refused_csr_keeps_the_current_certificate(live_server, make_node):
    handle = make_node("lost-one", state="lost")
    identity = NodeIdentity()
    _issue(handle.node, identity)
    before = identity.certificate_pem
    loop = RenewalLoop(identity, send=ControlPlane(live_server.url, handle.credential).certificate)
    assert loop.tick() is False  # 409 reregister_required
    assert identity.certificate_pem == before
