"""The data plane's answers to data requests (PUT, GET), apart from authorization and dispatch
(gpu_node/dataplane/requests.py) and connections, framing and sending (gpu_node/dataplane/server.py): what each request
does to the engine and which temporaries it leaves to be zeroed.

GET: each sequence's cached prefix is held (acquire) until the answer is sent (RequestHandler.frame_done releases
them); its KV goes out straight from the pool's memory (`kv_views`, a read section a purge waits for) when the pool
is host memory in the engine dtype, else it is read into the connection's staging buffer first.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_node.agent.registry import HostedCache
from gpu_node.dataplane.admission import Hold
from gpu_node.dataplane.connection import Conn
from gpu_node.dataplane.io import tensor_bytes
from gpu_node.engine.kv_input import KVNotStorable
from gpu_node.engine.paged_cache import TORCH_DTYPES, PrefixNotCached
from gpu_node.errors import answer_error
from kcaas import wire


def answer_put(hosted: HostedCache, request: wire.DataRequest, tokens: list[np.ndarray]) -> list:
    """PUT: each sequence's KV into the engine. A frame carrying tokens[start:] only (the next frame of a long put)
    is appended after the cached prefix, which is not read back (PREFIX_NOT_CACHED when the cache no longer holds
    it); KV the cache cannot store is the client's to fix (bad_request). The sequences before a refused one are put."""
    engine, spec = hosted.engine, hosted.spec
    dtype = TORCH_DTYPES[spec.kv_dtype]
    num_cached, num_written, out_of_space = [], [], []
    for seq, (toks, kv_bytes, start) in enumerate(zip(tokens, request.kv, request.head.kv_start)):
        shape = (spec.num_layers, 2, len(toks) - start, spec.num_kv_heads, spec.head_dim)
        kv = torch.frombuffer(kv_bytes, dtype=dtype).view(shape) if kv_bytes.nbytes else torch.empty(shape, dtype=dtype)
        try:
            result = engine.put(toks, kv, start=start)
        except (PrefixNotCached, KVNotStorable) as exc:  # the client's to fix (the sequences before were put)
            raise answer_error(exc, sequence=seq) from None
        num_cached.append(result.num_cached_tokens)
        num_written.append(result.num_written_tokens)
        out_of_space.append(result.out_of_space)
    return wire.encode_put_ok(
        request.head.request_id, num_cached=num_cached, num_written=num_written, out_of_space=out_of_space
    )


def answer_get(
    conn: Conn,
    hosted: HostedCache,
    request: wire.DataRequest,
    tokens: list[np.ndarray],
    hold: Hold,
    max_frame_bytes: int,
) -> list:
    """Each sequence's cached prefix is held (acquire) until the answer is sent (RequestHandler.frame_done), and
    its KV goes out straight from the pool's memory (`kv_views`: no copy) when the pool is host memory in the engine
    dtype; otherwise it is read into the connection's staging buffer first."""
    engine, spec = hosted.engine, hosted.spec
    starts = request.head.kv_start
    conn.held_prefixes = handles = [engine.acquire(t) for t in tokens]
    cached = [handle.num_tokens for handle in handles]
    allowance = 256 + 72 * len(tokens)  # 3 ints of <= 20 digits per sequence
    ends = wire.get_kv_end(spec, cached, starts, max_frame_bytes=max_frame_bytes, metadata_allowance=allowance)
    hold.grow(sum(max(e - s, 0) for s, e in zip(starts, ends)) * spec.kv_bytes_per_token)  # the tenant's budget
    kv_out, staged = [], []
    for index, (handle, start, end) in enumerate(zip(handles, starts, ends)):
        views = engine.kv_views(handle, start, end) if end > start else []
        if views is None:
            staged.append(index)
        kv_out.append(views)
    if staged:
        _read_staged(conn, engine, [(i, handles[i], starts[i], ends[i]) for i in staged], kv_out)
    answer = wire.encode_get_ok(
        request.head.request_id,
        spec=spec,
        num_cached=cached,
        kv_start=list(starts),
        kv_end=list(ends),
        kv=kv_out,
        max_frame_bytes=max_frame_bytes,
    )
    conn.served = (engine, sum(max(end - start, 0) for start, end in zip(starts, ends)))
    return answer


def _read_staged(conn: Conn, engine, reads: list, kv_out: list) -> None:
    """Copy path of answer_get (device or quantized pools): read each held prefix up to its end into staging. A copy
    made on the way (a range of it, device KV brought to host) is kept in conn.temporaries: zeroed once sent."""
    spec, dtype = engine.spec, TORCH_DTYPES[engine.spec.kv_dtype]
    need = sum(end for _, _, _, end in reads) * spec.elements_per_token
    staging = conn.staging_for_get(need, dtype, engine.device)
    offset = 0
    for index, handle, start, end in reads:
        out = staging[offset : offset + end * spec.elements_per_token]
        offset += end * spec.elements_per_token
        kv = engine.read(handle, end, out=out)
        made = [kv] if kv.data_ptr() != out.data_ptr() else []  # read elsewhere than into the staging
        sent = kv if start == 0 else kv[:, :, start:end].contiguous()
        if sent is not kv:
            made.append(sent)
        if sent.device.type != "cpu":
            sent = sent.cpu()
            made.append(sent)
        conn.temporaries += made
        kv_out[index] = tensor_bytes(sent)


def count_served(conn: Conn) -> None:
    """A GET answer went out whole: its tokens of KV count as served (billing's read meter)."""
    served, conn.served = conn.served, None
    if served is not None and served[1]:
        served[0].count_served(served[1])


def release_prefixes(conn: Conn) -> None:
    handles, conn.held_prefixes = conn.held_prefixes, []
    for handle in handles:
        handle.release()
