"""Engine benchmark: put/get bandwidth against memcpy (into free blocks, and into a churned pool that must evict),
prefix lookup against vLLM-style sha256 hashing (per call, and hashed once per request then probed), pool
utilization on a ShareGPT-like trace against a paged (vLLM-style) baseline and static preallocation, and allocator
throughput.

    python -m bench.engine [--quick]

Prints a human table, then one JSON object on the last line. Everything is measured in one process, side by side
and interleaved round by round (median of the rounds, after warm-up rounds), because the machines this runs on are
shared and noisy: read the ratios (put_vs_memcpy, lookup_speedup_vs_sha256, ...), not the absolute figures.

Layout: Llama-3-8B-like (32 layers, 8 KV heads, head_dim 128, fp16 KV and storage, 16-token blocks), i.e. 128 KiB of
KV per token and 2 MiB per block.

Baselines are like for like (docs/performance.md, "Like-for-like baselines", says what each compares and why):
`lookup_speedup_vs_sha256` gives both contenders Python lists; `lookup_vs_prehashed_probe` compares against hashing
a request's blocks once and then only probing; `paged_baseline_utilization` is vLLM-style paging of the same
requests without prefix sharing; `put_churned_*` puts into a full pool, every put evicting.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import kcaas_kernels
from gpu_node.engine.block_pool import BlockPool
from gpu_node.engine.paged_cache import TORCH_DTYPES, PagedKVCache, default_device
from kcaas.spec import KVCacheSpec

GIB = 1 << 30
VOCAB_SIZE = 128_256  # Llama 3's
UTILIZATION_DEFINITION = (
    "time average over decode steps (after warm-up, while requests are waiting so the pool stays full) of "
    "live tokens x kv bytes/token / (blocks in use x block bytes)"
)
PAGED_BASELINE_DEFINITION = (
    "same steps and live tokens / tokens of the whole 16-token blocks the running requests hold under vLLM-style "
    "paging without prefix sharing (blocks allocated as tokens arrive: sum of ceil(length / 16) x 16)"
)
STATIC_DEFINITION = (
    "same steps and live tokens / tokens reserved by the running requests if each reserved prompt + max_tokens up "
    "front, max_tokens = context limit - prompt"
)


@dataclass(frozen=True)
class BenchConfig:
    pool_bytes: int  # the PagedKVCache measured by put/get
    seq_tokens: int  # tokens per put/get sequence
    rounds: int  # measured rounds (median); every round runs each contender once
    warmup_rounds: int
    lookup_num_seqs: int  # fully cached sequences looked up per round
    lookup_seq_tokens: int
    sim_pool_blocks: int  # the BlockPool of the batching simulation
    sim_num_requests: int
    alloc_pool_blocks: int
    alloc_batch: int
    alloc_cycles: int  # allocate+release cycles per round
    churn_pool_bytes: int  # the second PagedKVCache, kept full so that every put into it evicts


QUICK = BenchConfig(
    pool_bytes=3 * GIB // 2,
    seq_tokens=2048,
    rounds=7,
    warmup_rounds=2,
    lookup_num_seqs=64,
    lookup_seq_tokens=4096,
    sim_pool_blocks=8192,
    sim_num_requests=4000,
    alloc_pool_blocks=100_000,
    alloc_batch=256,
    alloc_cycles=200,
    churn_pool_bytes=3 * GIB // 2,
)
FULL = BenchConfig(
    pool_bytes=7 * GIB,
    seq_tokens=2048,
    rounds=15,
    warmup_rounds=3,
    lookup_num_seqs=256,
    lookup_seq_tokens=4096,
    sim_pool_blocks=16384,
    sim_num_requests=12000,
    alloc_pool_blocks=100_000,
    alloc_batch=256,
    alloc_cycles=400,
    churn_pool_bytes=3 * GIB,
)


def llama3_8b_like_spec(num_layers: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> KVCacheSpec:
    return KVCacheSpec(
        model_fingerprint="llama-3-8b-like",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        kv_dtype="float16",
        storage_dtype="float16",
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_rounds(contenders: dict, rounds: int, warmup_rounds: int) -> dict[str, float]:
    """Run every contender once per round, interleaved; median seconds of the measured rounds per contender."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(warmup_rounds + rounds):
        for name, fn in contenders.items():
            elapsed = fn()
            if index >= warmup_rounds:
                seconds[name].append(elapsed)
    return {name: statistics.median(values) for name, values in seconds.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- put / get / memcpy -----------------------------------------------------------------------------------------
class _KernelTimer:
    """Wraps kcaas_kernels.write_kv/read_kv (looked up by the engine per call): engine time apart from kernel time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = collections.Counter()

    @contextlib.contextmanager
    def installed(self):
        originals = {name: getattr(kcaas_kernels, name) for name in ("write_kv", "read_kv")}

        def wrap(name, fn):
            def timed(*args, **kwargs):
                _sync(self.device)
                start = time.perf_counter()
                result = fn(*args, **kwargs)
                _sync(self.device)
                self.seconds[name] += time.perf_counter() - start
                return result

            return timed

        for name, fn in originals.items():
            setattr(kcaas_kernels, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(kcaas_kernels, name, fn)


class ChurnedPuts:
    """Puts of new sequences into a pool that is full of cached, unheld sequences, so that every put evicts: the
    steady state of a cache in service, where a put takes its blocks from the LRU end instead of a free stack.

    Before each put (untimed) the first half of a recent sequence is acquired and released, as a read between
    writes would: those blocks become most recently used while the sequence's second half stays old, so the blocks a
    put evicts come from the tails of several sequences and are handed out in LRU order, not in ascending runs."""

    def __init__(self, cache: PagedKVCache, num_tokens: int, rng: np.random.Generator):
        self.cache, self.num_tokens, self.rng = cache, num_tokens, rng
        self.blocks_per_seq = -(-num_tokens // cache.block_size)
        num_seqs = cache.stats().num_blocks // self.blocks_per_seq
        if num_seqs < 2:
            raise SystemExit(f"the churned pool must hold two {num_tokens}-token sequences")
        self.recent: collections.deque = collections.deque(maxlen=num_seqs - 1)  # resident, mostly
        self.evicted_per_put: list[int] = []  # cached blocks each timed put evicted

    def fill(self, kv: torch.Tensor) -> int:
        """Put until the pool must evict, then as many puts again (untimed): the pool is in its steady state.
        Returns the sequences the pool holds."""
        num_seqs = 0
        while self.cache.stats().num_free_blocks >= self.blocks_per_seq:
            self._put(self._new_tokens(), kv)
            num_seqs += 1
        for _ in range(num_seqs):
            self._refresh()
            self._put(self._new_tokens(), kv)
        return num_seqs

    def put(self, kv: torch.Tensor, device: torch.device) -> float:
        """One timed put of a new sequence that must evict; returns its seconds."""
        self._refresh()
        tokens = self._new_tokens()
        stats = self.cache.stats()
        assert stats.num_free_blocks < self.blocks_per_seq, "a churned put must evict"
        _sync(device)
        begin = time.perf_counter()
        self._put(tokens, kv)
        _sync(device)
        elapsed = time.perf_counter() - begin
        self.evicted_per_put.append(self.cache.stats().num_evictions - stats.num_evictions)
        return elapsed

    def _new_tokens(self) -> np.ndarray:
        return self.rng.integers(0, VOCAB_SIZE, self.num_tokens).astype(np.int32)

    def _put(self, tokens: np.ndarray, kv: torch.Tensor) -> None:
        result = self.cache.put(tokens, kv)
        assert result.num_written_tokens == self.num_tokens and not result.out_of_space, result
        self.recent.append(tokens)

    def _refresh(self) -> None:
        if len(self.recent) > 1:  # not the latest: it is most recently used already
            tokens = self.recent[int(self.rng.integers(len(self.recent) - 1))]
            self.cache.acquire(tokens[: len(tokens) // 2]).release()


def measure_put_get(spec: KVCacheSpec, cfg: BenchConfig, device: torch.device) -> dict:
    start = time.perf_counter()
    cache = PagedKVCache(spec, hash_key=os.urandom(32), capacity_bytes=cfg.pool_bytes, device=device)
    _sync(device)
    attach_s = time.perf_counter() - start
    num_tokens = cfg.seq_tokens
    num_bytes = spec.kv_bytes_per_token * num_tokens
    blocks_per_seq = -(-num_tokens // spec.block_size)
    if cache.stats().num_blocks < blocks_per_seq:
        raise SystemExit(f"pool of {cfg.pool_bytes} bytes cannot hold one {num_tokens}-token sequence")
    kv_dtype = TORCH_DTYPES[spec.kv_dtype]
    shape = (spec.num_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)
    kv = torch.randn(shape, dtype=torch.float32, device=device).to(kv_dtype)
    memcpy_dst = torch.empty_like(kv)
    memcpy_dst.copy_(kv)  # touched: memcpy is timed into resident memory
    rng = np.random.default_rng(1234)
    stored: list[np.ndarray] = []
    churn_cache = PagedKVCache(spec, hash_key=os.urandom(32), capacity_bytes=cfg.churn_pool_bytes, device=device)
    churned = ChurnedPuts(churn_cache, num_tokens, np.random.default_rng(4321))

    def put_new():
        if cache.stats().num_free_blocks < blocks_per_seq:  # every put must write, never evict: start empty
            cache.clear()
            stored.clear()
        tokens = rng.integers(0, VOCAB_SIZE, num_tokens).astype(np.int32)
        _sync(device)
        begin = time.perf_counter()
        result = cache.put(tokens, kv)
        _sync(device)
        elapsed = time.perf_counter() - begin
        assert result.num_written_tokens == num_tokens and not result.out_of_space, result
        stored.append(tokens)
        return elapsed

    staging = torch.empty_like(kv)
    staging.copy_(kv)  # touched, like memcpy_dst: an engine reuses its staging buffer across gets

    def get_cached():  # into the engine's reusable staging buffer, the like-for-like of memcpy into touched memory
        tokens = stored[-1]
        begin = time.perf_counter()
        n, _ = cache.get(tokens, out=staging)
        _sync(device)
        elapsed = time.perf_counter() - begin
        assert n == num_tokens
        return elapsed

    def get_fresh_out():  # get allocating its output: fresh pages are faulted in (the gap to get is that cost)
        tokens = stored[-1]
        begin = time.perf_counter()
        n, out = cache.get(tokens)
        _sync(device)
        elapsed = time.perf_counter() - begin
        assert n == num_tokens
        del out
        return elapsed

    def put_churned():  # into a full pool: every put evicts blocks of older sequences (LRU)
        return churned.put(kv, device)

    def memcpy():
        begin = time.perf_counter()
        memcpy_dst.copy_(kv)
        _sync(device)
        return time.perf_counter() - begin

    def memcpy_fresh():  # into a newly allocated tensor, as get's output is
        begin = time.perf_counter()
        out = torch.empty_like(kv)
        out.copy_(kv)
        _sync(device)
        elapsed = time.perf_counter() - begin
        del out
        return elapsed

    put_new()
    n, out = cache.get(stored[-1])
    assert n == num_tokens and torch.equal(out, kv), "get did not return what put stored"
    del out
    n, out = cache.get(stored[-1], out=staging)
    assert n == num_tokens and torch.equal(out, kv), "get(out=) did not return what put stored"
    churn_seqs = churned.fill(kv)
    put_churned()
    n, out = churn_cache.get(churned.recent[-1], out=staging)
    assert n == num_tokens and torch.equal(out, kv), "get did not return what a churned put stored"
    churned.evicted_per_put.clear()
    contenders = {
        "memcpy": memcpy,
        "put": put_new,
        "put_churned": put_churned,
        "get": get_cached,
        "memcpy_fresh": memcpy_fresh,
        "get_fresh_out": get_fresh_out,
    }
    seconds = _median_rounds(contenders, cfg.rounds, cfg.warmup_rounds)
    timer = _KernelTimer(device)
    split_rounds = max(3, cfg.rounds // 2)
    with timer.installed():
        put_s = sum(put_new() for _ in range(split_rounds))
        get_s = sum(get_cached() for _ in range(split_rounds))
        put_write_s = timer.seconds["write_kv"]
        churned_s = sum(put_churned() for _ in range(split_rounds))
        churned_write_s = timer.seconds["write_kv"] - put_write_s
    gbps = {name: num_bytes / s / 1e9 for name, s in seconds.items()}
    cache.check_invariants()
    churn_cache.check_invariants()
    churn_stats = churn_cache.stats()
    evicted_per_put = statistics.mean(churned.evicted_per_put)
    assert min(churned.evicted_per_put) > 0, "every churned put evicts"
    churn_cache = churned = None  # the churn pool freed (not del: put_churned names it)
    return {
        "put_gbps": gbps["put"],
        "get_gbps": gbps["get"],
        "memcpy_gbps": gbps["memcpy"],
        "memcpy_fresh_gbps": gbps["memcpy_fresh"],
        "put_vs_memcpy": gbps["put"] / gbps["memcpy"],
        "get_vs_memcpy": gbps["get"] / gbps["memcpy"],
        "get_fresh_out_gbps": gbps["get_fresh_out"],
        "get_fresh_out_vs_memcpy_fresh": gbps["get_fresh_out"] / gbps["memcpy_fresh"],
        "put_ms": seconds["put"] * 1e3,
        "get_ms": seconds["get"] * 1e3,
        "memcpy_ms": seconds["memcpy"] * 1e3,
        "put_write_kv_fraction": put_write_s / put_s,
        "put_engine_overhead_ms": (put_s - put_write_s) / split_rounds * 1e3,
        "put_churned_gbps": gbps["put_churned"],
        "put_churned_vs_memcpy": gbps["put_churned"] / gbps["memcpy"],
        "put_churned_vs_put": gbps["put_churned"] / gbps["put"],
        "put_churned_ms": seconds["put_churned"] * 1e3,
        "put_churned_write_kv_fraction": churned_write_s / churned_s,
        "put_churned_engine_overhead_ms": (churned_s - churned_write_s) / split_rounds * 1e3,
        "put_churned_evicted_blocks_per_put": evicted_per_put,
        "churn_pool_blocks": churn_stats.num_blocks,
        "churn_pool_seqs": churn_seqs,
        "churn_pool_evictions": churn_stats.num_evictions,
        "get_read_kv_fraction": timer.seconds["read_kv"] / get_s,
        "get_engine_overhead_ms": (get_s - timer.seconds["read_kv"]) / split_rounds * 1e3,
        "put_get_seq_tokens": num_tokens,
        "put_get_seq_bytes": num_bytes,
        "pool_bytes": cache.stats().bytes_capacity,
        "pool_blocks": cache.stats().num_blocks,
        "attach_s": attach_s,
    }


# ---- lookup vs a sha256 loop, and vs vLLM's hash-once-then-probe ----------------------------------------------------
SHA256_ROOT = b"\x00" * 32
# Lookups per request in `lookup_vs_prehashed_probe`. vLLM hashes a request's blocks once, when it arrives, and uses
# those hashes for every probe of its prefix cache and again to publish the blocks it computed. A KCaaS node hashes
# the prompt on every call: per request the connector LOOKUPs it (get_num_new_matched_tokens), GETs the hit
# (acquire) and PUTs the computed KV, three hashings of the same tokens. The figure models them as three lookups.
PREHASHED_LOOKUPS_PER_REQUEST = 3


def sha256_chain_lookup(tokens: list[int], block_size: int, index: dict, fill: bool = False) -> int:
    """vLLM-style: per full block sha256(pickle((parent, tuple(block tokens)))), chained, one dict lookup per block."""
    parent = SHA256_ROOT
    num_cached = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = pickle.dumps((parent, tuple(tokens[start : start + block_size])), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(payload).digest()
        if fill:
            index[parent] = start // block_size
        elif index.get(parent) is None:
            break
        num_cached = start + block_size
    return num_cached


def sha256_block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's hashing of a request, done once when it arrives: the chained hash of every full block, as in
    sha256_chain_lookup (the hashes it would fill an index with)."""
    parent = SHA256_ROOT
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = pickle.dumps((parent, tuple(tokens[start : start + block_size])), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(payload).digest()
        hashes.append(parent)
    return hashes


def prehashed_probe(block_hashes: list[bytes], block_size: int, index: dict) -> int:
    """vLLM's lookup of a request already hashed: one dict probe per precomputed block hash up to the first miss;
    returns the cached tokens. (vLLM's own probe also builds a per-group key and collects the blocks: a bare
    dict.get is the cheapest probe, so the baseline is, if anything, faster than vLLM's.)"""
    num_blocks = 0
    for block_hash in block_hashes:
        if index.get(block_hash) is None:
            break
        num_blocks += 1
    return num_blocks * block_size


def prehashed_speedup(engine_s: float, hash_s: float, probe_s: float, lookups_per_request: int) -> float:
    """The engine's speedup over hash-once-then-probe for a request looked up `lookups_per_request` times: the
    baseline pays its hashing once and one probe per lookup, the engine pays a whole lookup (hashing) every time.
    Arguments are seconds per lookup of one request (hash_s: hashing it once)."""
    return (hash_s + lookups_per_request * probe_s) / (lookups_per_request * engine_s)


def prehashed_breakeven(engine_s: float, hash_s: float, probe_s: float) -> float | None:
    """Lookups per request from which hash-once-then-probe is faster than the engine (the speedup is 1 there);
    None when the engine's whole lookup costs no more than a bare probe (it is faster at any count)."""
    if engine_s <= probe_s:
        return None
    return hash_s / (engine_s - probe_s)


def half_cached_prompt(tokens: np.ndarray, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """A prompt of the same length whose first half (whole blocks) is the cached `tokens` and whose second half is
    new: its first token differs from the cached one there, so not even a partial block past the half matches."""
    half = len(tokens) // 2 // block_size * block_size
    tail = rng.integers(0, VOCAB_SIZE, len(tokens) - half).astype(tokens.dtype)
    tail[0] = (int(tokens[half]) + 1) % VOCAB_SIZE
    return np.concatenate([tokens[:half], tail])


def measure_lookup(cfg: BenchConfig, device: torch.device, main_spec: KVCacheSpec) -> dict:
    """Lookups of fully cached sequences (and of half-cached ones). Lookup cost does not depend on the bytes per
    token, so the many sequences are held by a cache with the same block size and a 1x1x1 layout (a few MiB of pool
    instead of tens of GiB)."""
    spec = llama3_8b_like_spec(num_layers=1, num_kv_heads=1, head_dim=1)
    assert spec.block_size == main_spec.block_size
    num_seqs, seq_tokens = cfg.lookup_num_seqs, cfg.lookup_seq_tokens
    num_blocks = num_seqs * (-(-seq_tokens // spec.block_size))
    cache = PagedKVCache(spec, hash_key=os.urandom(32), num_blocks=num_blocks, device=device)
    rng = np.random.default_rng(99)
    seqs = [rng.integers(0, VOCAB_SIZE, seq_tokens).astype(np.int32) for _ in range(num_seqs)]
    kv = torch.zeros((1, 2, seq_tokens, 1, 1), dtype=TORCH_DTYPES[spec.kv_dtype], device=device)
    for tokens in seqs:
        assert cache.put(tokens, kv).num_cached_tokens == seq_tokens
    token_lists = [tokens.tolist() for tokens in seqs]  # what a vLLM-style engine holds
    sha_index: dict[bytes, int] = {}
    for tokens in token_lists:
        sha256_chain_lookup(tokens, spec.block_size, sha_index, fill=True)
    full = (seq_tokens // spec.block_size) * spec.block_size
    prehashed = [sha256_block_hashes(tokens, spec.block_size) for tokens in token_lists]
    half_seqs = [half_cached_prompt(tokens, spec.block_size, rng) for tokens in seqs]
    half = len(half_seqs[0]) // 2 // spec.block_size * spec.block_size

    def engine():
        return _timed(lambda: [_expect(cache.lookup(tokens), seq_tokens) for tokens in seqs])

    def engine_lists():
        return _timed(lambda: [_expect(cache.lookup(tokens), seq_tokens) for tokens in token_lists])

    def engine_half():  # numpy input, as `engine`: the ratio is the engine's own work, no list conversion in it
        return _timed(lambda: [_expect(cache.lookup(tokens), half) for tokens in half_seqs])

    def sha256():
        return _timed(lambda: [_expect(sha256_chain_lookup(t, spec.block_size, sha_index), full) for t in token_lists])

    def sha256_hash_once():  # vLLM when a request arrives
        return _timed(lambda: [sha256_block_hashes(tokens, spec.block_size) for tokens in token_lists])

    def probe():  # vLLM's lookup of a request it has hashed
        return _timed(lambda: [_expect(prehashed_probe(h, spec.block_size, sha_index), full) for h in prehashed])

    contenders = {
        "engine": engine,
        "engine_lists": engine_lists,
        "engine_half": engine_half,
        "sha256": sha256,
        "sha256_hash_once": sha256_hash_once,
        "probe": probe,
    }
    seconds = _median_rounds(contenders, cfg.rounds, cfg.warmup_rounds)
    total = num_seqs * seq_tokens
    rates = {name: total / s for name, s in seconds.items()}
    sha256_rate = rates["sha256"] * full / seq_tokens  # tokens the baseline hashed (whole blocks)
    per_seq = {name: s / num_seqs for name, s in seconds.items()}
    engine_s, hash_s, probe_s = per_seq["engine_lists"], per_seq["sha256_hash_once"], per_seq["probe"]
    lookups = PREHASHED_LOOKUPS_PER_REQUEST
    return {
        "lookup_tokens_per_s": rates["engine"],
        "lookup_tokens_per_s_list_input": rates["engine_lists"],
        "sha256_baseline_tokens_per_s": sha256_rate,
        "lookup_speedup_vs_sha256": rates["engine_lists"] / sha256_rate,
        "lookup_speedup_vs_sha256_numpy_input": rates["engine"] / sha256_rate,
        "sha256_hash_once_tokens_per_s": rates["sha256_hash_once"] * full / seq_tokens,
        "prehashed_probe_tokens_per_s": rates["probe"] * full / seq_tokens,
        "lookup_prehashed_lookups_per_request": lookups,
        "lookup_vs_prehashed_probe": prehashed_speedup(engine_s, hash_s, probe_s, lookups),
        "lookup_vs_prehashed_probe_1_lookup": prehashed_speedup(engine_s, hash_s, probe_s, 1),
        "lookup_prehashed_breakeven_lookups": prehashed_breakeven(engine_s, hash_s, probe_s),
        "lookup_half_hit_vs_full_hit": seconds["engine_half"] / seconds["engine"],
        "lookup_full_hit_us": per_seq["engine"] * 1e6,
        "lookup_half_hit_us": per_seq["engine_half"] * 1e6,
        "lookup_num_seqs": num_seqs,
        "lookup_seq_tokens": seq_tokens,
        "lookup_num_cached_blocks": cache.stats().num_cached_blocks,
    }


def _expect(got: int, want: int) -> None:
    assert got == want, (got, want)


# ---- utilization on a ShareGPT-like trace -----------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    max_context: int


def sharegpt_like_trace(
    num_requests: int,
    *,
    seed: int = 0,
    mean_prompt: float = 161.0,
    mean_output: float = 338.0,
    sigma: float = 1.0,
    max_context: int = 2048,
) -> Trace:
    """Lognormal prompt and output lengths (long tail), prompt + output <= max_context, location parameters fitted so
    the means after capping are the vLLM paper's ShareGPT means (161 prompt, 338 output tokens)."""
    rng = np.random.default_rng(seed)
    z_prompt, z_output = rng.standard_normal(num_requests), rng.standard_normal(num_requests)

    def fit(z, target, upper):
        mu = np.log(target) - sigma**2 / 2
        for _ in range(50):
            values = np.clip(np.rint(np.exp(mu + sigma * z)), 1, upper)
            mu += np.log(target / values.mean())
        return values.astype(np.int64)

    prompt = fit(z_prompt, mean_prompt, max_context - 1)
    output = fit(z_output, mean_output, max_context - prompt)
    return Trace(prompt, output, max_context)


def paged_reserved_tokens(lengths, block_size: int) -> int:
    """Token slots vLLM-style paging holds for sequences of these lengths, without prefix sharing: blocks are
    allocated as tokens arrive, so each sequence holds ceil(length / block_size) whole blocks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return int((-(-lengths // block_size)).sum()) * block_size


def simulate_paged_batching(
    trace: Trace, num_blocks: int, block_size: int, warmup_steps: int, watermark_blocks: int = 1
) -> dict:
    """Continuous batching over BlockPool: admit while free blocks >= prompt blocks + watermark_blocks (1: the
    prompt plus one block), one block more whenever a
    sequence's last block is full and it produces a token, release a request's blocks when it finishes. When a step
    has too few free blocks, the latest admitted requests are preempted (recompute: blocks released, requeued first
    with the tokens they have). Statistics are taken per decode step after `warmup_steps` while requests wait."""
    pool = BlockPool(num_blocks, block_size)
    waiting = collections.deque((rid, int(trace.prompt_tokens[rid])) for rid in range(len(trace.prompt_tokens)))
    running_ids: list[int] = []  # admission order
    lengths: list[int] = []
    block_lists: list[list[int]] = []
    total = trace.prompt_tokens + trace.output_tokens
    total_list = total.tolist()
    reserve_context = np.full_like(total, trace.max_context)  # prompt + (max_context - prompt)
    reserve_round256 = np.minimum(trace.prompt_tokens + -(-trace.output_tokens // 256) * 256, trace.max_context)
    samples = collections.defaultdict(list)
    num_preemptions = step = 0
    while waiting or running_ids:
        while waiting and pool.num_free_blocks >= -(-waiting[0][1] // block_size) + watermark_blocks:
            rid, length = waiting.popleft()
            running_ids.append(rid)
            lengths.append(length)
            block_lists.append(pool.allocate(-(-length // block_size)))
        needy = [i for i, length in enumerate(lengths) if length % block_size == 0]
        while len(needy) > pool.num_free_blocks:  # preempt the latest admitted
            rid, length, blocks = running_ids.pop(), lengths.pop(), block_lists.pop()
            pool.release(blocks[::-1])
            waiting.appendleft((rid, length))
            num_preemptions += 1
            needy = [i for i in needy if i < len(lengths)]
        for i, block_id in zip(needy, pool.allocate(len(needy))):
            block_lists[i].append(block_id)
        lengths = [length + 1 for length in lengths]  # this step's token has its slot now
        if step >= warmup_steps and waiting:
            ids = np.asarray(running_ids)
            live = sum(lengths)
            used = pool.num_used_blocks
            assert used == sum(len(blocks) for blocks in block_lists)
            samples["utilization"].append(live / (used * block_size))
            samples["paged_baseline"].append(live / paged_reserved_tokens(lengths, block_size))
            samples["occupancy"].append(used / num_blocks)
            samples["static_context"].append(live / int(reserve_context[ids].sum()))
            samples["static_round256"].append(live / int(reserve_round256[ids].sum()))
            samples["batch"].append(len(lengths))
        finished = [i for i, (rid, length) in enumerate(zip(running_ids, lengths)) if length >= total_list[rid]]
        for i in reversed(finished):
            pool.release(block_lists[i][::-1])
            del running_ids[i], lengths[i], block_lists[i]
        step += 1
    assert pool.num_free_blocks == num_blocks
    if not samples["utilization"]:
        raise SystemExit("the trace never kept the pool full after warm-up: use more requests")
    mean = {name: float(np.mean(values)) for name, values in samples.items()}
    return {
        "utilization": mean["utilization"],
        "utilization_definition": UTILIZATION_DEFINITION,
        "paged_baseline_utilization": mean["paged_baseline"],
        "paged_baseline_definition": PAGED_BASELINE_DEFINITION,
        "utilization_vs_paged_baseline": mean["utilization"] / mean["paged_baseline"],
        "utilization_vs_static_prealloc": mean["utilization"] / mean["static_context"],
        "pool_occupancy": mean["occupancy"],
        "static_prealloc_utilization": mean["static_context"],
        "static_prealloc_definition": STATIC_DEFINITION,
        "static_prealloc_round256_utilization": mean["static_round256"],
        "sim_mean_batch": mean["batch"],
        "sim_steps_measured": len(samples["utilization"]),
        "sim_steps_total": step,
        "sim_preemptions": num_preemptions,
        "sim_pool_blocks": num_blocks,
        "sim_num_requests": len(total),
        "trace_mean_prompt": float(trace.prompt_tokens.mean()),
        "trace_mean_output": float(trace.output_tokens.mean()),
        "trace_p99_prompt": float(np.percentile(trace.prompt_tokens, 99)),
        "trace_p99_output": float(np.percentile(trace.output_tokens, 99)),
    }


# ---- allocator ----------------------------------------------------------------------------------------------------
def measure_alloc_free(cfg: BenchConfig) -> dict:
    pool = BlockPool(cfg.alloc_pool_blocks, 16)
    batch = cfg.alloc_batch

    def cycles():
        start = time.perf_counter()
        for _ in range(cfg.alloc_cycles):
            pool.release(pool.allocate(batch))
        return time.perf_counter() - start

    seconds = _median_rounds({"cycles": cycles}, cfg.rounds, cfg.warmup_rounds)["cycles"]
    return {"alloc_free_blocks_per_s": cfg.alloc_cycles * batch / seconds, "alloc_batch": batch}


def _published_pool(num_blocks: int, chain_blocks: int, block_size: int) -> BlockPool:
    """A pool whose every block is cached and unheld: chains of `chain_blocks` under made-up hashes."""
    pool = BlockPool(num_blocks, block_size)
    root = hashlib.blake2b(b"root", digest_size=16).digest()
    tokens = np.arange(block_size, dtype=np.int32)
    counter = 0
    while pool.num_free_blocks:
        ids = pool.allocate(min(chain_blocks, pool.num_free_blocks))
        parent = root
        for block_id in ids:
            counter += 1
            block_hash = counter.to_bytes(16, "little")
            pool.cache_block(block_id, parent, tokens, block_hash)
            parent = block_hash
        pool.release(ids[::-1])
    return pool


def measure_alloc_evict(cfg: BenchConfig, chain_blocks: int = 128) -> dict:
    """Every allocation evicts: allocate(batch) over a fully published pool until it is drained, then release it all
    (unpublished, so to the free stack); blocks / (allocate time + release time), median over rounds (the pool is
    rebuilt, untimed, before each round)."""
    batch = cfg.alloc_batch
    rounds = max(3, cfg.rounds // 2)
    seconds, evictions = [], 0
    for _ in range(rounds + 1):
        pool = _published_pool(cfg.alloc_pool_blocks, chain_blocks, 16)
        start = time.perf_counter()
        taken = []
        while pool.num_evictable_blocks:
            taken.append(pool.allocate(batch))
        for ids in taken:
            pool.release(ids)
        seconds.append(time.perf_counter() - start)
        evictions = pool.num_evictions
    assert evictions == cfg.alloc_pool_blocks
    return {
        "alloc_evict_blocks_per_s": cfg.alloc_pool_blocks / statistics.median(seconds[1:]),
        "alloc_evict_chain_blocks": chain_blocks,
        "alloc_pool_blocks": cfg.alloc_pool_blocks,
    }


# ---- report -------------------------------------------------------------------------------------------------------
def _kernels_impl(device: torch.device) -> str:
    """What kcaas_kernels.write_kv/read_kv run here: Triton on CUDA, the plain-torch reference elsewhere (kernels/)."""
    if getattr(kcaas_kernels, "__file__", None) is None:
        return "injected stand-in module (not kernels/)"
    return "triton" if device.type == "cuda" and getattr(kcaas_kernels, "HAS_TRITON", False) else "torch reference"


def _source_version() -> str:
    """The commit measured, '+dirty' when the work tree differs from it ('unknown' outside a git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty.strip() else "")


def _environment(device: torch.device, mode: str) -> dict:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    return {
        "mode": mode,
        "device": str(device),
        "kernels_impl": _kernels_impl(device),
        "source": _source_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_start": os.getloadavg()[0],  # other processes on the machine: > 0 means contention
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "transparent_hugepage": thp,
    }


def _or_never(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def _table(results: dict) -> str:
    r = results
    rows = [
        (
            f"put (new {r['put_get_seq_tokens']}-token seqs)",
            f"{r['put_gbps']:.2f} GB/s",
            f"{r['put_vs_memcpy']:.2f} x memcpy (>= 0.8)",
        ),
        (
            "put, churned pool",
            f"{r['put_churned_gbps']:.2f} GB/s",
            f"{r['put_churned_vs_memcpy']:.2f} x memcpy, {r['put_churned_vs_put']:.2f} x put into free blocks; "
            f"{r['put_churned_evicted_blocks_per_put']:.0f} blocks evicted per put",
        ),
        (
            "get (cached seqs, out=)",
            f"{r['get_gbps']:.2f} GB/s",
            f"{r['get_vs_memcpy']:.2f} x memcpy (>= 0.8); into a reused staging buffer",
        ),
        ("memcpy (touched dst)", f"{r['memcpy_gbps']:.2f} GB/s", "dst.copy_(src), same bytes"),
        (
            "get, fresh output",
            f"{r['get_fresh_out_gbps']:.2f} GB/s",
            f"{r['get_fresh_out_vs_memcpy_fresh']:.2f} x memcpy into fresh memory",
        ),
        ("memcpy (fresh dst)", f"{r['memcpy_fresh_gbps']:.2f} GB/s", "first touch of new pages"),
        (
            "  put: write_kv share",
            f"{r['put_write_kv_fraction']:.0%}",
            f"the engine's own work: {r['put_engine_overhead_ms']:.2f} ms/put",
        ),
        (
            "  churned put: write_kv",
            f"{r['put_churned_write_kv_fraction']:.0%}",
            f"the engine's own work: {r['put_churned_engine_overhead_ms']:.2f} ms/put",
        ),
        (
            "  get: read_kv share",
            f"{r['get_read_kv_fraction']:.0%}",
            f"the engine's own work: {r['get_engine_overhead_ms']:.2f} ms/get",
        ),
        (
            "lookup, list input",
            f"{r['lookup_tokens_per_s_list_input'] / 1e6:.1f} M tok/s",
            f"{r['lookup_speedup_vs_sha256']:.2f} x sha256 loop, both on Python lists (>= 5)",
        ),
        (
            "  vs hash once + probe",
            f"{r['lookup_vs_prehashed_probe']:.2f} x",
            f"vLLM hashes a request once, then probes; {r['lookup_prehashed_lookups_per_request']} lookups/request "
            f"(1 lookup: {r['lookup_vs_prehashed_probe_1_lookup']:.2f} x; break-even at "
            f"{_or_never(r['lookup_prehashed_breakeven_lookups'])} lookups/request)",
        ),
        (
            "lookup, numpy input",
            f"{r['lookup_tokens_per_s'] / 1e6:.1f} M tok/s",
            f"{r['lookup_speedup_vs_sha256_numpy_input']:.2f} x sha256 loop on lists (not like for like)",
        ),
        (
            "lookup, half cached",
            f"{r['lookup_half_hit_vs_full_hit']:.2f} x full hit",
            f"{r['lookup_half_hit_us']:.0f} us vs {r['lookup_full_hit_us']:.0f} us, same length, numpy input (<= 0.6)",
        ),
        ("sha256 chain + dict", f"{r['sha256_baseline_tokens_per_s'] / 1e6:.1f} M tok/s", "vLLM-style, per full block"),
        (
            "sha256, hashing once",
            f"{r['sha256_hash_once_tokens_per_s'] / 1e6:.1f} M tok/s",
            "vLLM's per-request hashing (on arrival)",
        ),
        (
            "probe of prehashed",
            f"{r['prehashed_probe_tokens_per_s'] / 1e6:.1f} M tok/s",
            "vLLM's lookup of a hashed request: dict.get per block",
        ),
        (
            "utilization (paged)",
            f"{r['utilization']:.4f}",
            f"{r['utilization_vs_paged_baseline']:.3f} x paged baseline (>= 0.97 absolute)",
        ),
        (
            "paged baseline util.",
            f"{r['paged_baseline_utilization']:.4f}",
            "vLLM-style paging, no prefix sharing, same requests and steps",
        ),
        (
            "pool occupancy",
            f"{r['pool_occupancy']:.4f}",
            f"blocks in use / pool blocks; {r['sim_preemptions']} preemptions, {r['sim_num_requests']} requests",
        ),
        (
            "utilization, 1% watermark",
            f"{r['utilization_watermark_1pct']:.4f}",
            f"occupancy {r['pool_occupancy_watermark_1pct']:.4f}, {r['sim_preemptions_watermark_1pct']} preemptions",
        ),
        (
            "static prealloc util.",
            f"{r['static_prealloc_utilization']:.4f}",
            f"strawman: reserve prompt + (2048 - prompt); paged is {r['utilization_vs_static_prealloc']:.2f} x",
        ),
        (
            "static, output->256",
            f"{r['static_prealloc_round256_utilization']:.4f}",
            "reserve prompt + output rounded up to 256",
        ),
        ("alloc+release", f"{r['alloc_free_blocks_per_s'] / 1e6:.2f} M blocks/s", f"batch {r['alloc_batch']} (>= 1 M)"),
        ("alloc with eviction", f"{r['alloc_evict_blocks_per_s'] / 1e6:.2f} M blocks/s", "every block evicted"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"bench.engine ({r['mode']}): {r['device']}, kernels: {r['kernels_impl']}, "
        f"pool {r['pool_bytes'] / GIB:.2f} GiB ({r['pool_blocks']} blocks), torch threads {r['torch_threads']}",
    ]
    lines += [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c}" for a, b, c in rows]
    lines.append(f"  utilization: {UTILIZATION_DEFINITION}")
    lines.append(f"  paged baseline: {PAGED_BASELINE_DEFINITION}")
    lines.append(f"  static prealloc: {STATIC_DEFINITION}")
    lines.append(
        f"  (load average {r['loadavg_1min_at_start']:.1f} -> {r['loadavg_1min_at_end']:.1f} on "
        f"{r['cpu_count']} cores: a shared, noisy machine; read the ratios, measured side by side in this run)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small pool and few rounds (under a minute)")
    args = parser.parse_args(argv)
    missing = [name for name in ("write_kv", "read_kv", "copy_blocks") if not hasattr(kcaas_kernels, name)]
    if missing:
        print(f"bench.engine: kernels does not export {', '.join(missing)} yet", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else FULL
    device = default_device()
    spec = llama3_8b_like_spec()
    started = time.perf_counter()
    results = _environment(device, "quick" if args.quick else "full")
    results["spec"] = spec.to_dict()
    results["kv_bytes_per_token"] = spec.kv_bytes_per_token
    results["block_bytes"] = spec.block_bytes
    results.update(measure_put_get(spec, cfg, device))
    results.update(measure_lookup(cfg, device, spec))
    trace = sharegpt_like_trace(cfg.sim_num_requests)
    warmup_steps = 2 * int(trace.output_tokens.mean())
    results.update(simulate_paged_batching(trace, cfg.sim_pool_blocks, spec.block_size, warmup_steps))
    # vLLM's scheduler keeps a 1% watermark of free blocks at admission, which makes preemption rare.
    watermark = simulate_paged_batching(
        trace, cfg.sim_pool_blocks, spec.block_size, warmup_steps, watermark_blocks=cfg.sim_pool_blocks // 100
    )
    results["utilization_watermark_1pct"] = watermark["utilization"]
    results["pool_occupancy_watermark_1pct"] = watermark["pool_occupancy"]
    results["sim_preemptions_watermark_1pct"] = watermark["sim_preemptions"]
    results.update(measure_alloc_free(cfg))
    results.update(measure_alloc_evict(cfg))
    results["rounds"] = cfg.rounds
    results["warmup_rounds"] = cfg.warmup_rounds
    results["bench_seconds"] = time.perf_counter() - started
    results["loadavg_1min_at_end"] = os.getloadavg()[0]
    print(_table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
