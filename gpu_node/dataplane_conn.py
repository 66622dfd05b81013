"""One data-plane connection's state (gpu_node/dataplane.py serves it) and the hygiene of the buffers it fills.

Invariant: no buffer that held a tenant's bytes (KV or token ids) on their way through the node goes back to the
allocator with those bytes in it. Each is either zeroed right after its one use, or kept by the connection and
zeroed when the connection closes or its tenant is purged (DataPlaneServer.purge_tenant closes the connection):

- `put_staging`: the KV of the connection's puts, reused by each; zeroed when a larger one replaces it and at close;
- `get_staging`: a GET's KV read from a device or quantized pool, reused by each; the same;
- `fresh`: what the payload sink allocated for one frame (its token ids; the KV of a put read ahead while the
  staging was in use), zeroed once the frame is answered, or at close for a frame never handled;
- `temporaries`: copies an answer was sent from (a range of the staging, device KV copied to host), zeroed once
  the answer is sent;
- `scratch`: the frame decoder's read buffer (headers, metadata, the first and last bytes of a payload that did
  not go straight into the sink's memory), zeroed at close.
A token-only request's ids, buffered by the decoder itself, are zeroed once it is answered too (frame_done).

Cost: one memset per fresh buffer or temporary, of the size of the copy that filled it (pipelined puts, ranges of
GETs); the reused buffers are zeroed only when replaced or closed, so a connection's steady state adds nothing.
This relies on the engine keeping no reference to a request's buffers once a call returns (PagedKVCache copies
token ids into its block table and KV into its pool), as the reused staging always has.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

import torch

from gpu_node.admission import Hold
from gpu_node.zeroing import zero
from gpu_node.registry import HostedCache


@dataclass
class Session:
    hosted: HostedCache
    claims: dict
    identity: object = None  # the KVCacheSpec its HELLO carried, checked against the cache's: requests may omit it
    max_answer_bytes: int | None = None  # the largest GET answer agreed at HELLO (None: the node's max_frame_bytes)


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    peer: str
    thread: threading.Thread | None = None
    sessions: dict[str, Session] = field(default_factory=dict)
    failed_hellos: int = 0
    put_staging: bytearray = field(default_factory=bytearray)
    put_staging_owner: int | None = None  # id(meta) of the frame whose payload is in put_staging, until handled
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

    # ---- the payload sink's buffers -------------------------------------------------------------------------------
    def put_buffers(self, key: int, token_bytes: int, kv_total: int) -> list:
        """[token ids, KV] buffers for a put's payload: the KV goes into the staging, or into a fresh buffer while
        a frame read ahead of this one still holds it (bounded by max_frame_bytes either way)."""
        tokens = bytearray(token_bytes)
        if self.put_staging_owner is not None:
            kv = bytearray(kv_total)
            self.fresh[key] = [tokens, kv]
            return [tokens, kv]
        if len(self.put_staging) < kv_total:
            zero(self.put_staging)  # the smaller one goes back to the allocator: nothing of the last puts in it
            self.put_staging = bytearray(kv_total)
        self.put_staging_owner = key
        self.fresh[key] = [tokens]
        return [tokens, memoryview(self.put_staging)[:kv_total]]

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
        if self.put_staging_owner == key:
            self.put_staging_owner = None

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
        zero(self.put_staging)
        if self.get_staging is not None:
            zero(self.get_staging)
        if self.scratch is not None:
            zero(self.scratch)

    def serves_tenant(self, tenant_id: str) -> bool:
        """Whether a session of this connection was opened for the tenant (by its token's `sub`, or the cache's
        owner): its bytes may be in this connection's buffers."""
        tenant_id = str(tenant_id)
        subs = tuple(self.tenants)  # copied at once: the connection's thread may add to them
        owners = [s.hosted.tenant_id for s in tuple(self.sessions.values())]
        return tenant_id in owners or tenant_id in subs or f"tenant:{tenant_id}" in subs
