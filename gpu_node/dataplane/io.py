"""Socket plumbing of the data-plane server: reads that fill a payload's own memory, sends of many buffers
without joining them (sendmsg on a Unix socket, per-view writes under TLS), listener, socket option and shutdown
helpers, and the TLS 1.3 server context.

Plaintext hygiene: a buffer this module fills with a request's or an answer's bytes (the join of small views) is
zeroed before it is released; TLS contexts get OpenSSL's SSL_OP_CLEANSE_PLAINTEXT, so the record buffer a
received record was decrypted in is cleansed once its bytes are handed over (and when the connection is freed)."""

from __future__ import annotations

import os
import socket
import ssl
import struct

import torch

from gpu_node.engine.zeroing import zero
from kcaas.wire.sendbuffers import send_buffers as _send_buffers

OP_CLEANSE_PLAINTEXT = 0x2  # SSL_OP_CLEANSE_PLAINTEXT (OpenSSL >= 3.0); the ssl module has no name for it

_FILL_BYTES = 4 << 20  # a payload read goes on for up to this much before the decoder is told
UDS_SEND_BUFFER_BYTES = 4 << 20


def recv_into(sock, buf: memoryview, *, fill: bool) -> int:
    """One read; into a payload's own memory, keep reading while bytes come (a TLS socket returns one 16 KiB
    record per read: without this the loop's per-read bookkeeping, not the copy, would bound a put's speed). A
    timeout or a closed stream after some bytes returns what arrived; the next read reports it."""
    n = sock.recv_into(buf)
    if not fill or n == 0:
        return n
    limit = min(len(buf), _FILL_BYTES)
    while n < limit:
        try:
            got = sock.recv_into(buf[n:limit])
        except TimeoutError:
            break
        if got == 0:
            break
        n += got
    return n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(torch.uint8).reshape(-1).numpy().data  # the array's buffer as a byte view, no copy


def send_buffers(sock, buffers: list) -> None:
    """Send [head+meta, *payload views] without joining large buffers (kcaas.wire.sendbuffers); a join of small views
    may hold KV, so it is zeroed once sent."""
    _send_buffers(sock, buffers, scrub=zero)


def send_quietly(sock, buffers: list) -> None:
    """A last answer before closing (the stream is bad): sent if the socket still takes it within a second."""
    try:
        sock.settimeout(1.0)
        send_buffers(sock, buffers)
    except (OSError, ssl.SSLError):
        pass


def hard_shutdown(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the base method: wakes a thread blocked in recv on any socket
    except OSError:
        pass


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def bind_uds(path: str) -> socket.socket:
    """A listening Unix socket at `path` (a stale one is replaced), for this node's group only."""
    unlink_quietly(path)
    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.bind(path)
    os.chmod(path, 0o660)  # same-host engines of this node's group only; tokens still required
    uds.listen(128)
    return uds


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def tune_socket(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:  # a Unix socket: a larger send buffer means fewer, larger copies per GET answer (capped by wmem_max)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UDS_SEND_BUFFER_BYTES)


def source_of(sock: socket.socket, addr) -> str:
    """Who a connection comes from, for the per-source limits: its address over TCP, its peer's uid over a Unix
    socket (SO_PEERCRED)."""
    if sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return f"uds:{struct.unpack('3i', creds)[1]}"
        except OSError:
            return "uds"
    return str(addr[0]) if addr else "?"


# ---- TLS helpers ----------------------------------------------------------------------------------------------------
def server_tls_context(
    certfile: str, keyfile: str, *, cafile: str | None = None, require_client_cert: bool = False
) -> ssl.SSLContext:
    """A TLS 1.3-only server context (optionally mutual TLS with the platform CA)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    cleanse_plaintext(ctx)
    ctx.load_cert_chain(certfile, keyfile)
    if cafile:
        ctx.load_verify_locations(cafile)
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def harden_server_context(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """A server context built elsewhere, made what the data plane serves: TLS 1.3 only, plaintext cleansed."""
    if ctx.minimum_version < ssl.TLSVersion.TLSv1_3:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return cleanse_plaintext(ctx)


def cleanse_plaintext(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """OpenSSL cleanses each decrypted record once its bytes are read, and a connection's buffers when it is freed:
    no plaintext of a tenant's KV stays in a record buffer or in the freed heap after it."""
    ctx.options |= OP_CLEANSE_PLAINTEXT
    return ctx
