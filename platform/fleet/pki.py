"""The platform CA: signs node certificates that name a node, `spiffe://kcaas/node/<node id>`, for mutual TLS
between nodes (migration) and for the node's TLS data plane.

The CA key is ECDSA P-256: settings.KCAAS_PLATFORM_CA_KEY_PEM when set (production: from a secret store), else the
0600 PKCS#8 file settings.KCAAS_PLATFORM_CA_KEY_FILE, created once atomically (audit.keys'
`load_or_create_private_file`). The CA certificate is derived from the key alone (fixed subject, serial from the key,
fixed validity, deterministic ECDSA), so every control-plane process serves byte-identical CA PEM without a second
secret to distribute; rotating the CA means a new key.

Invariants of `node_certificate_issue`:
- the CSR's self-signature verifies (the caller holds the private key) and its key is ECDSA P-256, else InvalidCsr
  (400, code csr_malformed | csr_signature_invalid | csr_key_unsupported);
- everything the CSR asks for besides its key (subject, SANs, extensions) is ignored: the certificate names exactly
  one URI, the node's SPIFFE id, plus the IP/DNS name of the node's registered endpoint host; EKU serverAuth +
  clientAuth; not a CA; valid from now - 5 minutes (clock skew) for KCAAS_NODE_CERT_HOURS; a random serial;
- the node row records the serial and not_after, and one audit event (NODE_CERTIFICATE_ISSUED) is written in the
  same transaction. The caller holds the node's row lock (fleet.services).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings
from django.utils import timezone

from audit.actions import AuditAction
from audit.keys import load_or_create_private_file
from audit.services import audit_record
from fleet.errors import InvalidCsr
from fleet.models import Node

# the same constant as gpu_node.agent.identity (fleet cannot import gpu_node)
SPIFFE_NODE_PREFIX = "spiffe://kcaas/node/"
CA_COMMON_NAME = "KCaaS platform CA"
BACKDATE = dt.timedelta(minutes=5)
MAX_CSR_BYTES = 16 * 1024
_CA_NOT_BEFORE = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
_CA_NOT_AFTER = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)  # RFC 5280 4.1.2.5: no expiry


def _new_p256_pem() -> bytes:
    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@lru_cache(maxsize=4)
def _ca(pem_setting: str, file_setting: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    pem = pem_setting.encode() if pem_setting else load_or_create_private_file(Path(file_setting), _new_p256_pem)
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("the platform CA key must be an ECDSA P-256 private key")
    return key, _ca_certificate(key)


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    """The self-signed CA certificate, a pure function of the key (so all processes agree on its bytes)."""
    public = key.public_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    spki = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    serial = int.from_bytes(hashlib.sha256(spki).digest()[:19], "big") | 1  # positive, at most 152 bits, nonzero
    usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(_CA_NOT_BEFORE)
        .not_valid_after(_CA_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256(), ecdsa_deterministic=True)
    )


def platform_ca() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    return _ca(settings.KCAAS_PLATFORM_CA_KEY_PEM, settings.KCAAS_PLATFORM_CA_KEY_FILE)


def platform_ca_pem() -> str:
    return platform_ca()[1].public_bytes(serialization.Encoding.PEM).decode()


def csr_public_key(csr_pem: str | bytes) -> ec.EllipticCurvePublicKey:
    """The P-256 public key of a well-formed CSR whose self-signature verifies; InvalidCsr otherwise."""
    data = csr_pem.encode() if isinstance(csr_pem, str) else csr_pem
    if not data or len(data) > MAX_CSR_BYTES:
        raise InvalidCsr(f"The CSR must be one PEM certificate request of at most {MAX_CSR_BYTES} bytes.")
    try:
        csr = x509.load_pem_x509_csr(data)
        signed = csr.is_signature_valid
        public = csr.public_key()
    except (ValueError, TypeError, x509.UnsupportedGeneralNameType) as error:
        raise InvalidCsr("The CSR is not a readable PEM certificate request.", details={"reason": str(error)}) from None
    if not signed:
        raise InvalidCsr("The CSR's signature does not verify.", code="csr_signature_invalid")
    if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP256R1):
        raise InvalidCsr("The CSR's key must be an ECDSA P-256 public key.", code="csr_key_unsupported")
    return public


def endpoint_host_name(endpoint: str) -> x509.GeneralName | None:
    """The IP or DNS SAN of a "host:port" endpoint (validated by fleet.validators), None when there is none."""
    host = endpoint.rpartition(":")[0].strip("[]")
    if not host:
        return None
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def node_certificate_issue(*, node: Node, csr_pem: str | bytes, now: dt.datetime | None = None) -> tuple[str, str]:
    """(certificate PEM, CA PEM) for `node` from its CSR; records serial/not_after on the node and audits it.

    `now` is injectable (tests issue already-expired certificates with a past `now`). The caller runs this inside
    a transaction holding the node's row lock."""
    public = csr_public_key(csr_pem)
    ca_key, ca_cert = platform_ca()
    now = (now or timezone.now()).replace(microsecond=0)  # X.509 times have whole seconds
    not_after = now + dt.timedelta(hours=settings.KCAAS_NODE_CERT_HOURS)
    cert = _node_certificate(node, public, ca_key, ca_cert, not_before=now - BACKDATE, not_after=not_after)
    before = {"certificate_serial": node.certificate_serial, "certificate_not_after": node.certificate_not_after}
    node.certificate_serial, node.certificate_not_after = format(cert.serial_number, "x"), not_after
    node.save(update_fields=["certificate_serial", "certificate_not_after", "updated_at"])
    audit_record(
        action=AuditAction.NODE_CERTIFICATE_ISSUED,
        target_type="node",
        target_id=node.pk,
        old=before,
        new={
            "certificate_serial": node.certificate_serial,
            "certificate_not_after": not_after,
            "spiffe_id": SPIFFE_NODE_PREFIX + str(node.pk),
            "endpoint": node.endpoint,
        },
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), platform_ca_pem()


def _node_certificate(
    node: Node, public, ca_key, ca_cert: x509.Certificate, *, not_before: dt.datetime, not_after: dt.datetime
) -> x509.Certificate:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(SPIFFE_NODE_PREFIX + str(node.pk))]
    host = endpoint_host_name(node.endpoint) if node.endpoint else None
    if host is not None:
        names.append(host)
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=True)  # critical: the subject is empty
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
