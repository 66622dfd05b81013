"""The node's identity: its own private key (generated here, never sent anywhere), the certificate the platform CA
issued for it (`spiffe://kcaas/node/<node id>`), and the CA certificate it trusts. No Django.

Node-to-node connections (migration) are mutual TLS 1.3 only, both sides presenting their node certificate and
trusting only the platform CA:

    server: ctx = identity.server_context(); conn = ctx.wrap_socket(sock, server_side=True)
            peer = peer_node_id(conn)                   # the verified peer's node id
    client: conn = identity.client_context().wrap_socket(sock)  # no host-name check: the SPIFFE id is checked
            expect_peer(conn, target_node_id)           # raises PeerIdentityError on any other node
    or:     conn = identity.connect("host:port", target_node_id)  # both steps

The node's sealing key (kcaas/node_protocol/sealing.py: X25519, a key of its own, not the certificate's ECDSA key) is
kept beside it: `load_sealing_key(directory)` reads `node-sealing.key` there or makes and saves one (0600); without a
directory the agent holds a fresh one in memory. Its public half goes to the control plane in every registration, and
the keys in provisioning and migration orders are sealed to it.

Invariants:
- the private keys never leave the process except into KCAAS_NODE_IDENTITY_DIR files created 0600;
- `install` accepts only a certificate for this node's current (or pending, see `renewal_csr_pem`) key, signed by
  the given CA, carrying exactly one SPIFFE node URI; the node id never changes once set;
- contexts handed out by `server_context()`/`client_context()` are re-loaded with the new certificate on every
  `install`, so a long-lived listener keeps serving across renewals (new handshakes get the new certificate);
- TLS 1.3 only, CERT_REQUIRED both ways; a client that does not call `expect_peer` has NOT authenticated the
  peer's node id (the client context does not check host names: node certificates name nodes, not hosts).
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
import tempfile
import threading
import uuid
import weakref
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.x509.oid import NameOID

from gpu_node.errors import NodeError
from gpu_node.tiers.durable_file import replace_file
from kcaas.node_protocol.sealing import NodeSealingKey

logger = logging.getLogger("kcaas.node.identity")
SPIFFE_NODE_PREFIX = "spiffe://kcaas/node/"
KEY_FILE, CERT_FILE, CA_FILE = "node.key", "node.pem", "ca.pem"
SEALING_KEY_FILE = "node-sealing.key"


class PeerIdentityError(NodeError, ConnectionError):
    """The peer's verified certificate does not name the expected node (or names no node at all); an OSError, so
    a caller treating failed connections as OSError treats this one the same."""


class IdentityError(NodeError, ValueError):
    """A certificate that this identity cannot install (wrong key, wrong CA, no node URI, another node)."""


def spiffe_node_uri(node_id: str) -> str:
    return SPIFFE_NODE_PREFIX + str(uuid.UUID(str(node_id)))


def node_id_of_uri(uri: str) -> str | None:
    """The canonical node id of a `spiffe://kcaas/node/<uuid>` URI, else None."""
    if not uri.startswith(SPIFFE_NODE_PREFIX):
        return None
    try:
        return str(uuid.UUID(uri[len(SPIFFE_NODE_PREFIX) :]))
    except ValueError:
        return None


def node_id_of_certificate(cert: x509.Certificate) -> str:
    """The node id of a node certificate: exactly one URI SAN, and it is a SPIFFE node URI."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound:
        uris = []
    node_ids = [node_id_of_uri(uri) for uri in uris]
    if len(node_ids) != 1 or node_ids[0] is None:
        raise IdentityError(f"a node certificate carries exactly one {SPIFFE_NODE_PREFIX}<id> URI, not {uris}")
    return node_ids[0]


def peer_node_id(ssl_sock: ssl.SSLSocket) -> str:
    """The node id in the SPIFFE URI SAN of the peer's certificate, which the handshake verified against the CA.

    PeerIdentityError when the peer sent no (verified) certificate or it names no node / several URIs."""
    peer = ssl_sock.getpeercert()  # {} or None unless the chain was verified (CERT_REQUIRED)
    if not peer:
        raise PeerIdentityError("the peer presented no verified certificate")
    sans: tuple[tuple[str, str], ...] = peer.get("subjectAltName", ())  # type: ignore[assignment]  # pairs, per ssl
    uris = [value for kind, value in sans if kind == "URI"]
    node_ids = [node_id_of_uri(uri) for uri in uris]
    if len(node_ids) != 1 or node_ids[0] is None:
        raise PeerIdentityError(f"the peer certificate names no single node (URIs: {uris})")
    return node_ids[0]


def expect_peer(ssl_sock: ssl.SSLSocket, node_id: str) -> str:
    """The peer's node id when it is `node_id`; PeerIdentityError (and nothing else) otherwise."""
    actual = peer_node_id(ssl_sock)
    if actual != str(uuid.UUID(str(node_id))):
        raise PeerIdentityError(f"connected to node {actual}, expected node {node_id}")
    return actual


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _csr_pem(key, common_name: str) -> bytes:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def _same_key(a, b) -> bool:
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return a.public_bytes(*fmt) == b.public_bytes(*fmt)


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _load_chain(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """ssl only loads key material from files: a private 0700 directory, files removed right after loading."""
    with tempfile.TemporaryDirectory(prefix="kcaas-identity-") as directory:
        cert_path, key_path = Path(directory) / CERT_FILE, Path(directory) / KEY_FILE
        cert_path.write_bytes(cert_pem)
        _write_private(key_path, key_pem)
        ctx.load_cert_chain(str(cert_path), str(key_path))


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by its owner only, replacing it atomically and durably (never
    world-readable; durable_file.replace_file: a temp file of this write's own, fsync, rename, fsync dir)."""
    replace_file(path, data, mode=0o600)


class NodeIdentity:
    """A node's key, its platform-issued certificate and the platform CA; thread-safe."""

    def __init__(self, key: ec.EllipticCurvePrivateKey | None = None):
        self._key = key or _new_key()
        self._pending_key: ec.EllipticCurvePrivateKey | None = None
        self._cert: x509.Certificate | None = None
        self._cert_pem = self._ca_pem = b""
        self._node_id: str | None = None
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # taken before _lock, never inside it
        self._contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()

    # ---- requesting and installing certificates ---------------------------------------------------------------------
    def csr_pem(self) -> bytes:
        """A CSR for the current key. Its subject is informative only: the CA names the certificate itself."""
        return _csr_pem(self._key, "kcaas node")

    def renewal_csr_pem(self) -> bytes:
        """A CSR for a fresh key kept pending: `install` of a certificate for it switches to that key (rotation)."""
        with self._lock:
            self._pending_key = _new_key()
            return _csr_pem(self._pending_key, "kcaas node")

    def install(self, cert_pem: bytes | str, ca_pem: bytes | str) -> str:
        """Take a certificate issued for this node's current or pending key; returns the node id it names.

        IdentityError when it is not signed by `ca_pem`, is for another key, carries no single node URI, or names
        another node than a previously installed certificate did. Handed-out contexts are re-loaded."""
        cert_pem, ca_pem = _as_bytes(cert_pem), _as_bytes(ca_pem)
        cert, ca = x509.load_pem_x509_certificate(cert_pem), x509.load_pem_x509_certificate(ca_pem)
        node_id = node_id_of_certificate(cert)
        if not _signed_by(cert, ca):
            raise IdentityError("the certificate is not signed by the given CA")
        with self._lock:
            if self._node_id is not None and node_id != self._node_id:
                raise IdentityError(f"the certificate names node {node_id}, this is node {self._node_id}")
            key = self._key_for(cert)
            self._key, self._pending_key = key, None
            self._cert, self._cert_pem, self._ca_pem, self._node_id = cert, cert_pem, ca_pem, node_id
            for ctx in list(self._contexts):
                self._load_into(ctx)
        return node_id

    def _key_for(self, cert: x509.Certificate):
        for key in (self._key, self._pending_key):
            if key is not None and _same_key(key.public_key(), cert.public_key()):
                return key
        raise IdentityError("the certificate is not for this node's key")

    # ---- state ------------------------------------------------------------------------------------------------------
    @property
    def node_id(self) -> str | None:
        return self._node_id

    @property
    def has_certificate(self) -> bool:
        return self._cert is not None

    @property
    def certificate_pem(self) -> bytes:
        return self._cert_pem

    @property
    def ca_pem(self) -> bytes:
        return self._ca_pem

    @property
    def not_valid_before(self) -> dt.datetime:
        return self._require_cert().not_valid_before_utc

    @property
    def not_valid_after(self) -> dt.datetime:
        return self._require_cert().not_valid_after_utc

    def renewal_due_at(self) -> dt.datetime:
        """Half-way through the certificate's validity."""
        cert = self._require_cert()
        return cert.not_valid_before_utc + (cert.not_valid_after_utc - cert.not_valid_before_utc) / 2

    def _require_cert(self) -> x509.Certificate:
        if self._cert is None:
            raise IdentityError("no certificate installed yet")
        return self._cert

    # ---- TLS --------------------------------------------------------------------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        """Mutual TLS 1.3 server: presents the node certificate, requires a client certificate from the CA."""
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        """Mutual TLS 1.3 client: presents the node certificate, verifies the server against the CA only. Host
        names are not checked: call `expect_peer(conn, node_id)` after the handshake (or use `connect`)."""
        return self._context(ssl.PROTOCOL_TLS_CLIENT)

    def dataplane_server_context(self) -> ssl.SSLContext:
        """TLS 1.3 server for the data plane: the node certificate (whose IP/DNS SAN is the endpoint host), no
        client certificate (SDK clients authenticate with data tokens and verify the server with the CA)."""
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def connect(self, endpoint: str, node_id: str, *, timeout: float = 10.0) -> ssl.SSLSocket:
        """A mutual-TLS connection to `endpoint` ("host:port") whose peer is verified to be node `node_id`."""
        host, _, port = endpoint.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        try:
            conn = self.client_context().wrap_socket(sock)
            expect_peer(conn, node_id)
        except BaseException:
            sock.close()
            raise
        return conn

    def _context(self, protocol: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        with self._lock:
            self._require_cert()
            self._load_into(ctx)
            self._contexts.add(ctx)
        return ctx

    def _load_into(self, ctx: ssl.SSLContext) -> None:
        """(Re-)load certificate, key and trust into `ctx`; called with the lock held. Trust only grows: a context
        that trusted the previous CA keeps trusting it (CA rotation overlaps), new contexts trust the current one."""
        ctx.load_verify_locations(cadata=self._ca_pem.decode())
        _load_chain(ctx, self._cert_pem, _key_pem(self._key))

    # ---- persistence (KCAAS_NODE_IDENTITY_DIR) -----------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Key, certificate and CA as 0600 files in `directory` (created 0700), each replaced atomically."""
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._save_lock:  # two saves never interleave: the files on disk are one snapshot's key and certificate
            with self._lock:
                key_pem, cert_pem, ca_pem = _key_pem(self._key), self._cert_pem, self._ca_pem
            _write_private(directory / KEY_FILE, key_pem)
            if cert_pem:
                _write_private(directory / CERT_FILE, cert_pem)
                _write_private(directory / CA_FILE, ca_pem)

    @classmethod
    def load(cls, directory: str | Path) -> NodeIdentity:
        """The identity saved in `directory` (its certificate installed when there is one), else a fresh one."""
        directory = Path(directory)
        if not (directory / KEY_FILE).exists():
            return cls()
        key = serialization.load_pem_private_key((directory / KEY_FILE).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
            raise IdentityError("the saved node key is not an ECDSA P-256 key")
        identity = cls(key)
        if (directory / CERT_FILE).exists() and (directory / CA_FILE).exists():
            identity.install((directory / CERT_FILE).read_bytes(), (directory / CA_FILE).read_bytes())
        return identity


def load_sealing_key(directory: str | Path) -> NodeSealingKey:
    """The node's sealing key saved in `directory` (node-sealing.key, PKCS#8 PEM), or a new one saved there 0600
    (the directory created 0700). One key per node identity directory, kept across restarts, so orders sealed while
    the agent was down still open after it comes back."""
    directory = Path(directory)
    path = directory / SEALING_KEY_FILE
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, x25519.X25519PrivateKey):
            raise IdentityError(f"{path} is not an X25519 key")
        return NodeSealingKey(key)
    sealing_key = NodeSealingKey()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    pem = x25519.X25519PrivateKey.from_private_bytes(sealing_key.private_bytes()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_private(path, pem)
    return sealing_key


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


class RenewalLoop:
    """Renews the certificate at half-life on its own thread: `send(csr_pem: str) -> {"certificate",
    "ca_certificate"}` (the agent's POST /api/v1/nodes/certificate) with a fresh key each time; after `save` (when
    given) the new key and certificate are persisted. A failed renewal is retried every `retry_seconds` (the
    current certificate stays in use until it expires; a 409 reregister_required is the heartbeat's to handle, and
    a re-registration installs a new certificate). `tick()` is the one renewal step, for tests."""

    def __init__(self, identity: NodeIdentity, *, send, save=None, retry_seconds: float = 30.0, clock=None):
        self._identity, self._send, self._save, self.retry_seconds = identity, send, save, retry_seconds
        self._clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def seconds_until_due(self) -> float:
        return max(0.0, (self._identity.renewal_due_at() - self._clock()).total_seconds())

    def tick(self) -> bool:
        """Renew now; True when a new certificate was installed."""
        try:
            answer = self._send(self._identity.renewal_csr_pem().decode())
            self._identity.install(answer["certificate"], answer["ca_certificate"])
        except Exception as error:  # noqa: BLE001 - the loop must survive; the old certificate is still valid
            logger.warning("certificate renewal failed: %s", error)
            return False
        if self._save is not None:
            self._save()
        logger.info("node certificate renewed, valid until %s", self._identity.not_valid_after)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kcaas-cert-renewal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.seconds_until_due()):
            if not self.tick() and self._stopped.wait(self.retry_seconds):
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
