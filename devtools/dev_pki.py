"""Development TLS material: a private CA and a server certificate for 127.0.0.1 / localhost (ECDSA P-256).

For `make up`, the tests and the benchmarks only; production node certificates come from the platform CA (issue 6).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_ca(common_name: str, *, valid_for: dt.timedelta):
    """(private key, self-signed CA certificate) allowed to sign certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _host_names(hosts) -> list:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _leaf_cert(ca_key, ca_cert, common_name: str, names: list, usages: list, valid_for: dt.timedelta):
    """(private key, certificate): a fresh P-256 key, `names` as SANs, `usages` as extended key usages."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + valid_for)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def new_server_cert(
    ca_key, ca_cert, common_name: str, *, valid_for: dt.timedelta, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
):
    """(private key, certificate) for a TLS server answering on `hosts`, signed by the CA."""
    return _leaf_cert(ca_key, ca_cert, common_name, _host_names(hosts), [ExtendedKeyUsageOID.SERVER_AUTH], valid_for)


def pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only: created 0600, and an existing file made 0600 before it is
    truncated, so its new content is never readable by anyone else, whatever the umask or its old mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(fd, 0o600)
        out.truncate(0)
        out.write(data)


def private_directory(directory: Path) -> Path:
    """`directory`, created 0700 when it does not exist (an existing one keeps its mode: it may be shared)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def write_dev_pki(
    directory: Path, *, server_name: str = "kcaas node", valid_for: dt.timedelta = dt.timedelta(hours=1)
) -> dict[str, str]:
    """A fresh CA and server certificate as files in `directory`: {"ca", "ca_key", "cert", "key"} -> path. Every
    file 0600 (certificates too: dev PKI files are the one user's), the directory 0700 when made here."""
    directory = private_directory(directory)
    ca_key, ca_cert = new_ca("KCaaS dev CA", valid_for=valid_for)
    key, cert = new_server_cert(ca_key, ca_cert, server_name, valid_for=valid_for)
    paths = {
        name: directory / file
        for name, file in (("ca", "ca.pem"), ("ca_key", "ca.key"), ("cert", "server.pem"), ("key", "server.key"))
    }
    write_private(paths["ca"], pem_cert(ca_cert))
    write_private(paths["ca_key"], pem_key(ca_key))
    write_private(paths["cert"], pem_cert(cert))
    write_private(paths["key"], pem_key(key))
    return {name: str(path) for name, path in paths.items()}


def new_node_cert(
    ca_key,
    ca_cert,
    node_id: str,
    *,
    valid_for: dt.timedelta = dt.timedelta(hours=1),
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
):
    """(private key, certificate) of a node as the platform CA issues it: one URI SAN `spiffe://kcaas/node/<id>`
    plus the hosts, usable as TLS server and client (node-to-node mutual TLS)."""
    names = [x509.UniformResourceIdentifier(f"spiffe://kcaas/node/{node_id}"), *_host_names(hosts)]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf_cert(ca_key, ca_cert, f"kcaas node {node_id}", names, usages, valid_for)


def write_node_pki(directory: Path, ca_key, ca_cert, node_id: str) -> dict[str, str]:
    """A node certificate of `node_id` as files in `directory`: {"ca", "cert", "key"} -> path (0600 each)."""
    directory = private_directory(directory)
    key, cert = new_node_cert(ca_key, ca_cert, node_id)
    paths = {
        "ca": directory / "ca.pem",
        "cert": directory / f"node-{node_id}.pem",
        "key": directory / f"node-{node_id}.key",
    }
    write_private(paths["ca"], pem_cert(ca_cert))
    write_private(paths["cert"], pem_cert(cert))
    write_private(paths["key"], pem_key(key))
    return {name: str(path) for name, path in paths.items()}
