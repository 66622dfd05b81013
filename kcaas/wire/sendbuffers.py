"""Sending a frame's buffers — [header + metadata, *payload views] — with as few writes as the socket allows, and no
join of large buffers. Shared by the SDK and the node (stdlib only); the node passes `scrub` to zero the small
joins it made, since they may hold a tenant's bytes.

- A frame of at most 64 KiB goes out as one joined write.
- A Unix socket takes the views in sendmsg calls of up to 64 buffers (one syscall for a header, the token ids and
  the KV that follow), advancing by index on a partial send.
- TLS (an SSLSocket has no sendmsg): views of at least one record (16 KiB) go straight from their memory; runs of
  smaller ones are joined first, so a header and token ids do not each cost a record and a wake-up of the peer.
"""

from __future__ import annotations

import ssl

COALESCE_BYTES = 64 * 1024
DIRECT_MIN_BYTES = 16 * 1024  # one TLS record: smaller views are joined before encryption
IOV_PER_SEND = 64  # buffers offered to one sendmsg (Linux takes at most 1024)


def send_buffers(sock, buffers: list, scrub=None) -> None:
    """Send every buffer, in order. `scrub(buf)`, when given, is called on each join once it is sent."""
    views = [_bytes(b) for b in buffers]
    views = [v for v in views if v.nbytes]
    if sum(v.nbytes for v in views) <= COALESCE_BYTES:
        _send_joined(sock, views, scrub)
    elif not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg"):
        _sendmsg_all(sock, views)
    else:
        _send_records(sock, views, scrub)


def _bytes(buf) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sendmsg_all(sock, views: list[memoryview]) -> None:
    first = 0  # views[:first] are sent
    while first < len(views):
        # a blocking sendmsg returns after about one socket buffer: offering many more buffers than that only costs
        # building their iovec array again on every call
        sent = sock.sendmsg(views[first : first + IOV_PER_SEND])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _send_records(sock, views: list[memoryview], scrub) -> None:
    pending: list[memoryview] = []
    pending_bytes = 0
    for view in views:
        if view.nbytes >= DIRECT_MIN_BYTES:
            if pending:
                _send_joined(sock, pending, scrub)
                pending, pending_bytes = [], 0
            sock.sendall(view)
            continue
        pending.append(view)
        pending_bytes += view.nbytes
        if pending_bytes >= COALESCE_BYTES:
            _send_joined(sock, pending, scrub)
            pending, pending_bytes = [], 0
    if pending:
        _send_joined(sock, pending, scrub)


def _send_joined(sock, views: list[memoryview], scrub) -> None:
    joined = bytearray().join(views)
    try:
        sock.sendall(joined)
    finally:
        if scrub is not None:
            scrub(joined)
