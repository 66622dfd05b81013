"""One data-plane connection's state (gpu_node/dataplane/server.py serves it), its read deadlines, and the hygiene of
the buffers it fills.

Invariant: no buffer that held a tenant's bytes (KV or token ids) on their way through the node goes back to the
allocator with those bytes in it. Each is either zeroed right after its one use, or kept by the connection and
zeroed when the connection closes or its tenant is purged (DataPlaneServer.purge_tenant closes the connection):

- `leases`: a put's KV lands in staging lent by the node's StagingPool (gpu_node/dataplane/staging.py) for that frame
  only
  and given back once it is answered; the pool zeroes a buffer before another tenant's bytes land in it, and the
  server zeroes the tenant's idle buffers when its connection closes or it is purged;
- `get_staging`: a GET's KV read from a device or quantized pool, reused by each; zeroed when a larger one replaces
  it and at close;
- `fresh`: what the payload sink allocated for one frame (its token ids), zeroed once the frame is answered, or at
  close for a frame never handled;
- `temporaries`: copies an answer was sent from (a range of the staging, device KV copied to host), zeroed once
  the answer is sent;
- `scratch`: the frame decoder's read buffer (headers, metadata, the first and last bytes of a payload that did
  not go straight into the sink's memory), zeroed at close.
A token-only request's ids, buffered by the decoder itself, are zeroed once it is answered too (frame_done).

Cost: one memset per fresh buffer or temporary, of the size of the copy that filled it (token ids, ranges of GETs);
staging is zeroed only when it changes tenant or its tenant leaves, so a connection's steady state adds nothing.
This relies on the engine keeping no reference to a request's buffers once a call returns (PagedKVCache copies
token ids into its block table and KV into its pool), as the reused staging always has.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from gpu_node.agent.registry import HostedCache
from gpu_node.dataplane.admission import Hold, NodeLimits
from gpu_node.engine.zeroing import zero
from kcaas.spec import KVCacheSpec


@dataclass
class Session:
    hosted: HostedCache
    claims: dict
    identity: KVCacheSpec | None = None  # what its HELLO carried, checked against the cache: requests may omit it
    max_answer_bytes: int | None = None  # the largest GET answer agreed at HELLO (None: the node's max_frame_bytes)


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    peer: str
    source: str = "?"  # the address (or Unix peer uid) the per-source limits count it under
    accepted_at: float = 0.0  # time.monotonic() at accept: the HELLO deadline runs from here
    authenticated: bool = False  # a HELLO succeeded once (no longer counted as unauthenticated)
    thread: threading.Thread | None = None
    sessions: dict[str, Session] = field(default_factory=dict)
    failed_hellos: int = 0
    leases: dict = field(default_factory=dict)  # id(frame meta) -> the staging Lease a put's KV is received into
    get_staging: torch.Tensor | None = None
    tenants: set[str] = field(default_factory=set)  # tenants with a session here (each counted once by admission)
    holds: dict[int, Hold] = field(default_factory=dict)  # id(frame meta) -> the admission of a request read ahead
    request_heads: dict = field(default_factory=dict)  # id(frame meta) -> its RequestHead, parsed once by the sink
    held_prefixes: list = field(default_factory=list)  # a GET's PrefixHandles, held until its answer is sent
    served: tuple | None = None  # (engine, tokens of KV) of the GET answer being sent: counted once it is sent
    busy: bool = False  # a frame has started arriving or is being handled (drain waits for it)
    closing: bool = False  # drain chose to close this idle connection
    fresh: dict[int, list] = field(default_factory=dict)  # id(frame meta) -> the sink's fresh buffers for that frame
    temporaries: list = field(default_factory=list)  # copies the answer being sent was made from
    scratch: memoryview | None = None  # the frame decoder's read buffer
    frame_started: float | None = None  # time.monotonic() when the frame now arriving began (None between frames)
    read_timeout: float | None = None  # the socket's timeout as last set (settimeout only when it changes)

    # ---- the payload sink's buffers -------------------------------------------------------------------------------
    def put_buffers(self, key: int, token_bytes: int, lease) -> list:
        """[token ids, KV] buffers for a put's payload: the KV goes into the staging `lease` (a pipelined put read
        ahead has its own), given back when the frame is answered."""
        tokens = bytearray(token_bytes)
        self.fresh[key] = [tokens]
        self.leases[key] = lease
        return [tokens, lease.view]

    def staging_for_get(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The GET staging (on the engines' device), grown when it is too small or of another dtype: the old one
        is zeroed first."""
        staging = self.get_staging
        if staging is None or staging.dtype != dtype or staging.numel() < numel:
            if staging is not None:
                zero(staging)
            staging = self.get_staging = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return staging

    # ---- zeroing ----------------------------------------------------------------------------------------------------
    def frame_done(self, key: int, payload) -> None:
        """A frame is answered: zero the buffers its request filled (the sink's fresh ones, else the decoder's own
        payload: token ids) and the copies its answer was sent from; give the staging back."""
        buffers = self.fresh.pop(key, None)
        for buf in buffers if buffers is not None else payload:
            zero(buf)
        self.zero_temporaries()
        lease = self.leases.pop(key, None)
        if lease is not None:
            lease.give_back()

    def zero_temporaries(self) -> None:
        temporaries, self.temporaries = self.temporaries, []
        for buf in temporaries:
            zero(buf)

    def scrub(self) -> None:
        """Zero every buffer the connection kept (it is closed, or its tenant purged). Idempotent."""
        for buffers in self.fresh.values():
            for buf in buffers:
                zero(buf)
        self.fresh.clear()
        self.zero_temporaries()
        for lease in self.leases.values():
            lease.give_back()  # the server then has the pool zero this tenant's idle staging
        self.leases.clear()
        if self.get_staging is not None:
            zero(self.get_staging)
        if self.scratch is not None:
            zero(self.scratch)

    def uses_any_token(self, jtis: set[str]) -> bool:
        """Whether a session of this connection was opened with one of these data tokens."""
        return any(str(s.claims.get("jti")) in jtis for s in tuple(self.sessions.values()))

    def serves_tenant(self, tenant_id: str) -> bool:
        """Whether a session of this connection was opened for the tenant (by its token's `sub`, or the cache's
        owner): its bytes may be in this connection's buffers."""
        tenant_id = str(tenant_id)
        subs = tuple(self.tenants)  # copied at once: the connection's thread may add to them
        owners = [s.hosted.tenant_id for s in tuple(self.sessions.values())]
        return tenant_id in owners or tenant_id in subs or f"tenant:{tenant_id}" in subs


@dataclass(frozen=True)
class Deadlines:
    """How long a connection's next read may wait. Between frames `idle_timeout`; inside one the rest of
    `frame_timeout`, and at most the node's payload_stall_timeout without a byte; before the first good HELLO, never
    past the node's hello_timeout from accept (a connection that never authenticates holds nothing long)."""

    idle_timeout: float
    frame_timeout: float
    limits: NodeLimits

    def arm(self, conn: Conn, in_frame: bool) -> bool:
        """Set the connection's socket timeout for its next read (a syscall only when it changes); False when a
        deadline has already passed."""
        if not in_frame:
            conn.frame_started = None
        elif conn.frame_started is None:
            conn.frame_started = time.monotonic()
        wanted = self.read_timeout(conn, conn.frame_started)
        if wanted is None:
            return False
        if wanted != conn.read_timeout:
            conn.read_timeout = wanted
            conn.sock.settimeout(wanted)
        return True

    def read_timeout(self, conn: Conn, frame_started: float | None) -> float | None:
        """The next read's timeout, or None when a deadline has passed."""
        now, limits = time.monotonic(), self.limits
        if frame_started is None:
            wait = self.idle_timeout
        else:
            wait = min(frame_started + self.frame_timeout - now, limits.payload_stall_timeout)
        if not conn.authenticated:
            wait = min(wait, conn.accepted_at + limits.hello_timeout - now)
        if wait <= 0:
            return None
        return wait if frame_started is not None or not conn.authenticated else self.idle_timeout
