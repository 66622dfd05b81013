"""bench.dataplane's node side and its raw peers: a node process (a DataPlaneServer over TLS 1.3 and a Unix socket,
hosting the caches a run asks for) with raw TLS / UDS servers beside it, the test PKI and data tokens, and the raw
client that pushes and pulls the same bytes over the same sockets.

Everything here runs in a process of its own (multiprocessing 'spawn'), so client and node never share a GIL.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import socket
import struct
import threading
import time
import uuid

ISSUER = "kcaas-control-plane"
NODE_ID = "bench-node"
EPOCH = 1
_RAW_HEAD = struct.Struct("!cQ")  # op (b"P" push to server, b"G" pull from server, b"Q" quit), length


def spec_from(fields: dict):
    from kcaas.spec import KVCacheSpec

    return KVCacheSpec(**fields)


# ---- PKI and tokens (as tests/gpu_node/dataplane/conftest.py) ----------------------------------------------------
def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_pki(directory: str) -> dict[str, str]:
    from devtools.dev_pki import write_dev_pki

    return write_dev_pki(directory, server_name=NODE_ID, valid_for=dt.timedelta(hours=2))


def make_signing():
    """(Ed25519 private key, JWKS dict with its public key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    members = {"crv": "Ed25519", "kty": "OKP", "x": _b64url(raw)}
    kid = _b64url(hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest())
    return private, {"keys": [{**members, "kid": kid, "use": "sig", "alg": "EdDSA"}]}


def make_token(private, jwks: dict, cache_id: str, ttl: int = 3600) -> str:
    import jwt

    now = int(time.time())
    claims = {
        "iss": ISSUER,
        "aud": f"cache:{cache_id}",
        "sub": "tenant:bench",
        "iat": now,
        "nbf": now,
        "exp": now + ttl,
        "jti": str(uuid.uuid4()),
        "epoch": EPOCH,
        "node": NODE_ID,
        "access": "readwrite",
        "scope": "kv:read kv:write",
    }
    return jwt.encode(claims, private, algorithm="EdDSA", headers={"kid": jwks["keys"][0]["kid"], "typ": "JWT"})


# ---- raw socket servers (in the node process) ---------------------------------------------------------------------
def recv_exact_into(sock, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _raw_serve(sock, buf: bytearray) -> None:
    """Serve one raw connection: P = receive n bytes (into a reused buffer) then ack 1 byte; G = send n bytes."""
    head = bytearray(_RAW_HEAD.size)
    view = memoryview(buf)
    try:
        while True:
            recv_exact_into(sock, memoryview(head))
            op, n = _RAW_HEAD.unpack(head)
            if op == b"P":
                recv_exact_into(sock, view[:n])
                sock.sendall(b"k")
            elif op == b"G":
                sock.sendall(view[:n])
            else:
                return
    except (OSError, ConnectionError):
        pass
    finally:
        try:
            sock.close()
        except OSError:
            pass


def _raw_listener(listener, tls_ctx, buf_bytes: int) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if tls_ctx is not None:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = tls_ctx.wrap_socket(conn, server_side=True)
        threading.Thread(
            target=_raw_serve, args=(conn, bytearray(os.urandom(1024)) * (buf_bytes // 1024)), daemon=True
        ).start()


def node_main(conn, pki: dict, jwks: dict, workdir: str, config: dict) -> None:
    """A node process: a DataPlaneServer (TLS + UDS) hosting config["caches"] ({cache_id: (spec fields, capacity
    bytes)}) with config["max_frame_bytes"], and, when config["raw_bytes"] is set, raw TLS / UDS servers of that
    many bytes per answer. config["cpus"]: the cores it may run on. Sends its addresses, then serves until told."""
    import torch

    from gpu_node.agent.registry import CacheRegistry
    from gpu_node.dataplane.server import DataPlaneServer, TokenVerifier, server_tls_context

    if config.get("cpus"):
        os.sched_setaffinity(0, set(config["cpus"]))
    torch.set_num_threads(1)
    caches = config["caches"]
    registry = CacheRegistry(device_capacity_bytes=sum(cap for _, cap in caches.values()), device="cpu")
    for cache_id, (fields, capacity) in caches.items():
        registry.provision(
            cache_id=cache_id,
            spec=spec_from(fields),
            capacity={"device": capacity},
            hash_key=os.urandom(32),
            epoch=EPOCH,
        )
    uds_path = os.path.join(workdir, f"dp-{os.getpid()}.sock")
    server = DataPlaneServer(
        registry,
        NODE_ID,
        TokenVerifier(jwks, issuer=ISSUER),
        server_tls_context(pki["cert"], pki["key"]),
        "127.0.0.1",
        0,
        uds_path=uds_path,
        max_frame_bytes=config["max_frame_bytes"],
        max_connections=64,
    )
    server.start()
    info = {"endpoint": server.endpoint, "uds": uds_path, "pid": os.getpid()}
    if config.get("raw_bytes"):
        raw_ctx = server_tls_context(pki["cert"], pki["key"])
        raw_tcp = socket.create_server(("127.0.0.1", 0))
        raw_uds_path = os.path.join(workdir, f"raw-{os.getpid()}.sock")
        raw_uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw_uds.bind(raw_uds_path)
        raw_uds.listen(8)
        for listener, ctx in ((raw_tcp, raw_ctx), (raw_uds, None)):
            threading.Thread(target=_raw_listener, args=(listener, ctx, config["raw_bytes"]), daemon=True).start()
        info.update(raw_tcp=raw_tcp.getsockname()[:2], raw_uds=raw_uds_path)
    conn.send(info)
    conn.recv()  # block until the bench says stop (or the pipe closes)
    server.stop()


class NodeProcess:
    """A node process started with `config` (see node_main); `.info` holds its addresses and pid."""

    def __init__(self, ctx, pki: dict, jwks: dict, workdir: str, config: dict):
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=node_main, args=(child, pki, jwks, workdir, config), daemon=True)
        self.process.start()
        if not self._conn.poll(180):
            raise SystemExit("bench.dataplane: a node process did not start within 180 s")
        self.info = self._conn.recv()

    def cpu_seconds(self) -> float:
        """User + system CPU time the node process has used so far (every thread)."""
        with open(f"/proc/{self.info['pid']}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except (OSError, BrokenPipeError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


# ---- client side ---------------------------------------------------------------------------------------------------
class RawClient:
    def __init__(self, sock):
        self.sock = sock
        self.ack = bytearray(1)

    def push(self, view: memoryview) -> None:
        self.sock.sendall(_RAW_HEAD.pack(b"P", view.nbytes))
        self.sock.sendall(view)
        recv_exact_into(self.sock, memoryview(self.ack))

    def pull(self, n: int, out: bytearray | None = None) -> bytearray:
        """n bytes from the node: into a fresh buffer per answer, or into `out` (reused, as get(out=) does)."""
        self.sock.sendall(_RAW_HEAD.pack(b"G", n))
        if out is None:
            out = bytearray(n)
        recv_exact_into(self.sock, memoryview(out)[:n])
        return out

    def close(self) -> None:
        try:
            self.sock.sendall(_RAW_HEAD.pack(b"Q", 0))
            self.sock.close()
        except OSError:
            pass
