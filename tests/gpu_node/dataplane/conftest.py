"""Fixtures for the data plane: a throwaway CA and server certificate, an Ed25519 token key, a registry with tiny
caches, and a DataPlaneServer on an ephemeral loopback port over real TLS 1.3 (plus a Unix socket)."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import ssl
import time
import uuid

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from devtools.dev_pki import write_dev_pki
from gpu_node.agent.registry import CacheRegistry
from gpu_node.dataplane.server import DataPlaneServer, TokenVerifier, server_tls_context
from kcaas import wire
from tests.gpu_node.kv_fixtures import tiny_spec

ISSUER = "kcaas-control-plane"
NODE_ID = "node-1"
CACHE_A = "c_aaaaaaaa"  # tenant A's cache
CACHE_B = "c_bbbbbbbb"  # tenant B's cache, on the same node
EPOCH = 3


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1 / localhost (files), valid for an hour."""
    return write_dev_pki(tmp_path_factory.mktemp("pki"), server_name=NODE_ID)


@pytest.fixture(scope="session")
def signing_key():
    return Ed25519PrivateKey.generate()


def public_jwk(private_key) -> dict:
    """Mirrors platform/caches/signing.public_jwk_of (OKP/Ed25519 JWK, RFC 7638 thumbprint as kid)."""
    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    members = {"crv": "Ed25519", "kty": "OKP", "x": _b64url(raw)}
    kid = _b64url(hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest())
    return {**members, "kid": kid, "use": "sig", "alg": "EdDSA"}


@pytest.fixture(scope="session")
def jwks(signing_key):
    return {"keys": [public_jwk(signing_key)]}


@pytest.fixture
def make_token(signing_key, jwks):
    """Signs a data token with the claim set of platform/caches/services.data_token_issue; overrides replace claims
    (None removes one)."""
    kid = jwks["keys"][0]["kid"]

    def make(cache_id: str = CACHE_A, *, key=None, algorithm="EdDSA", headers=None, **overrides) -> str:
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "aud": f"cache:{cache_id}",
            "sub": "tenant:t-a",
            "iat": now,
            "nbf": now,
            "exp": now + 300,
            "jti": str(uuid.uuid4()),
            "epoch": EPOCH,
            "node": NODE_ID,
            "access": "readwrite",
            "scope": "kv:read kv:write",
        }
        for name, value in overrides.items():
            if value is None:
                claims.pop(name, None)
            else:
                claims[name] = value
        return jwt.encode(
            claims,
            key if key is not None else signing_key,
            algorithm=algorithm,
            headers=headers if headers is not None else {"kid": kid, "typ": "JWT"},
        )

    return make


@pytest.fixture
def spec():
    return tiny_spec()


@pytest.fixture
def registry(spec):
    reg = CacheRegistry(device_capacity_bytes=64 << 20, device="cpu")
    for cache_id in (CACHE_A, CACHE_B):
        reg.provision(
            cache_id=cache_id,
            spec=spec,
            capacity={"device": 256 * spec.block_bytes},
            hash_key=cache_id.encode() * 4,
            epoch=EPOCH,
        )
    return reg


@pytest.fixture
def verifier(jwks):
    return TokenVerifier(jwks, issuer=ISSUER)


@pytest.fixture
def server(registry, verifier, pki, tmp_path):
    ctx = server_tls_context(pki["cert"], pki["key"])
    uds = str(tmp_path / "dp.sock")
    srv = DataPlaneServer(
        registry,
        NODE_ID,
        verifier,
        ctx,
        "127.0.0.1",
        0,
        uds_path=uds,
        max_frame_bytes=8 << 20,
        frame_timeout=1.0,
        idle_timeout=5.0,
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def client_ctx(pki):
    ctx = ssl.create_default_context(cafile=pki["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


class RawConn:
    """A bare TLS (or UDS) connection for sending hand-made frames and reading the node's answers."""

    def __init__(self, sock):
        self.sock = sock
        self.decoder = wire.FrameDecoder()
        self.rid = 100

    def send(self, buffers) -> None:
        self.sock.sendall(b"".join(bytes(b) for b in buffers))

    def read(self, timeout: float = 5.0):
        """The next frame, or None when the node closed the connection."""
        self.sock.settimeout(timeout)
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError, BrokenPipeError):
                return None
            if not data:
                return None
            self.decoder.feed(data)

    def closed(self, timeout: float = 5.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, ssl.SSLError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def hello(self, token: str, cache_id: str = CACHE_A):
        self.rid += 1
        self.send(wire.encode_hello(self.rid, cache_id=cache_id, token=token))
        return self.read()

    def request(self, opcode, tokens, *, cache_id=CACHE_A, identity=None, kv=None):
        self.rid += 1
        kwargs = {"kv": [kv]} if kv is not None else {}
        self.send(
            wire.encode_request(
                opcode, self.rid, cache_id=cache_id, identity=identity or tiny_spec(), token_ids=[tokens], **kwargs
            )
        )
        return self.read()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(server, client_ctx):
    conns = []

    def connect() -> RawConn:
        host, port = server.address
        s = client_ctx.wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname="127.0.0.1")
        conn = RawConn(s)
        conns.append(conn)
        return conn

    yield connect
    for c in conns:
        c.close()
