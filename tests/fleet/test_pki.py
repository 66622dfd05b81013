"""The platform CA (fleet.pki) through the node REST endpoints: what a node certificate names, which CSRs are
refused, renewal, and the CA key's file."""

import datetime as dt
import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from audit.actions import AuditAction
from audit.models import AuditEvent
from fleet import pki, services
from fleet.models import Node, NodeState
from gpu_node.agent.identity import NodeIdentity
from tests.fleet.conftest import capacity_body

REGISTER, RENEW = "/api/v1/nodes/register", "/api/v1/nodes/certificate"


def _csr(key, *, common_name="kcaas node", names=()) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return (
        builder.sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )


def _forged(csr_pem: str) -> str:
    """The same request with the last byte of its signature changed: well-formed, but not signed by its key."""
    der = bytearray(x509.load_pem_x509_csr(csr_pem.encode()).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01
    return x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()


def _register(handle, csr=None, endpoint="10.1.2.3:7443"):
    body = {"endpoint": endpoint, "capacity": capacity_body()}
    if csr is not None:
        body["csr"] = csr
    return handle.client.post(REGISTER, body, format="json")


def _sans(cert: x509.Certificate) -> list:
    return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def test_register_with_csr_issues_exactly_the_spiffe_and_endpoint_names(make_node):
    handle = make_node("n1", register=False)
    key = ec.generate_private_key(ec.SECP256R1())
    greedy = _csr(
        key,
        common_name="admin",
        names=[x509.DNSName("evil.example"), x509.UniformResourceIdentifier("spiffe://kcaas/node/other")],
    )
    response = _register(handle, greedy)
    assert response.status_code == 200, response.json()
    cert = x509.load_pem_x509_certificate(response.json()["certificate"].encode())
    ca = x509.load_pem_x509_certificate(response.json()["ca_certificate"].encode())
    assert _sans(cert) == [
        x509.UniformResourceIdentifier(f"spiffe://kcaas/node/{handle.node.pk}"),
        x509.IPAddress(ipaddress.ip_address("10.1.2.3")),
    ]
    assert cert.subject == x509.Name([])  # the CSR's CN=admin is ignored
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    cert.verify_directly_issued_by(ca)
    ekus = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(hours=12) + pki.BACKDATE


def test_issuing_records_serial_and_expiry_and_audits(make_node):
    handle = make_node("n1", register=False)
    response = _register(handle, NodeIdentity().csr_pem().decode())
    cert = x509.load_pem_x509_certificate(response.json()["certificate"].encode())
    node = handle.refresh()
    assert node.certificate_serial == format(cert.serial_number, "x")
    assert node.certificate_not_after == cert.not_valid_after_utc
    event = AuditEvent.objects.get(action=AuditAction.NODE_CERTIFICATE_ISSUED, target_id=str(node.pk))
    assert event.new_values["certificate_serial"] == node.certificate_serial


def test_register_without_csr_answers_no_certificate(make_node):
    body = _register(make_node("n1", register=False)).json()
    assert "certificate" not in body and "ca_certificate" not in body
    assert not AuditEvent.objects.filter(action=AuditAction.NODE_CERTIFICATE_ISSUED).exists()


def test_dns_endpoint_gets_a_dns_name(make_node):
    handle = make_node("n1", register=False)
    response = _register(handle, NodeIdentity().csr_pem().decode(), endpoint="gpu-7.Cluster.local:7443")
    cert = x509.load_pem_x509_certificate(response.json()["certificate"].encode())
    assert _sans(cert)[1] == x509.DNSName("gpu-7.cluster.local")


@pytest.mark.parametrize(
    ("make_csr", "code"),
    [
        (lambda: _forged(_csr(ec.generate_private_key(ec.SECP256R1()))), "csr_signature_invalid"),
        (lambda: _csr(ec.generate_private_key(ec.SECP384R1())), "csr_key_unsupported"),
        (lambda: _csr(ed25519.Ed25519PrivateKey.generate()), "csr_key_unsupported"),
        (lambda: "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", "csr_malformed"),
        (lambda: "not a csr", "csr_malformed"),
    ],
)
def test_bad_csr_refuses_the_registration(make_node, make_csr, code):
    handle = make_node("n1", register=False)
    response = _register(handle, make_csr())
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code
    node = handle.refresh()
    assert node.state == NodeState.REGISTERING and node.certificate_serial == ""  # nothing changed


def test_renewal_issues_a_new_certificate_for_the_new_key(make_node):
    handle = make_node("n1", register=False)
    identity = NodeIdentity()
    first = _register(handle, identity.csr_pem().decode()).json()
    identity.install(first["certificate"], first["ca_certificate"])
    response = handle.client.post(RENEW, {"csr": identity.renewal_csr_pem().decode()}, format="json")
    assert response.status_code == 200, response.json()
    old_serial = x509.load_pem_x509_certificate(first["certificate"].encode()).serial_number
    assert identity.install(response.json()["certificate"], response.json()["ca_certificate"]) == str(handle.node.pk)
    new = x509.load_pem_x509_certificate(identity.certificate_pem)
    assert new.serial_number != old_serial
    assert handle.refresh().certificate_serial == format(new.serial_number, "x")


def test_renewal_of_a_lost_or_unregistered_node_asks_to_register(make_node):
    csr = NodeIdentity().csr_pem().decode()
    for handle in (make_node("fresh", register=False), make_node("gone", state=NodeState.LOST)):
        response = handle.client.post(RENEW, {"csr": csr}, format="json")
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "reregister_required"


def test_renewal_with_forged_csr_is_refused(make_node):
    handle = make_node("n1")
    response = handle.client.post(RENEW, {"csr": _forged(NodeIdentity().csr_pem().decode())}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "csr_signature_invalid"
    assert handle.refresh().certificate_serial == ""


def test_renewal_needs_the_node_credential(make_node, tenant_key):
    from tests.fleet.conftest import bearer_client

    csr = NodeIdentity().csr_pem().decode()
    assert bearer_client(tenant_key).post(RENEW, {"csr": csr}, format="json").status_code == 401


def test_ca_key_file_is_created_once_0600_and_the_ca_certificate_follows_the_key(settings, tmp_path):
    settings.KCAAS_PLATFORM_CA_KEY_PEM = ""
    settings.KCAAS_PLATFORM_CA_KEY_FILE = str(tmp_path / "secrets" / "ca.pem")
    first = pki.platform_ca_pem()
    mode = stat.S_IMODE(os.stat(settings.KCAAS_PLATFORM_CA_KEY_FILE).st_mode)
    assert mode == 0o600
    pki._ca.cache_clear()  # another process: reads the same file, derives the same certificate bytes
    assert pki.platform_ca_pem() == first
    ca = x509.load_pem_x509_certificate(first.encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    ca.verify_directly_issued_by(ca)


def test_service_issues_with_an_injected_clock(make_node):
    handle = make_node("n1")
    node = Node.objects.get(pk=handle.node.pk)
    past = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    from django.db import transaction

    with transaction.atomic():
        cert_pem, _ = pki.node_certificate_issue(node=node, csr_pem=NodeIdentity().csr_pem(), now=past)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    assert cert.not_valid_after_utc == past + dt.timedelta(hours=12)
    assert services  # the REST paths above go through fleet.services
