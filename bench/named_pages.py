"""What the engines' plug-ins pay for keying KV by page instead of by prefix: the data path SGLang's HiCache backend
and vLLM's offloading tier share (kcaas.connectors.named_pages), against the full vLLM connector's on the same bytes.

    python -m bench.named_pages [--quick] [--page-tokens 64]

The vLLM bench's load (its 12-layer Llama's 2,000-token prompt, whole 128-token vLLM blocks: 1,920 tokens, 45 MiB of
float32 KV) from a node process over TLS 1.3, two ways, interleaved round by round (medians after a warm-up round):

- `prefix_*`: one sequence of 1,920 tokens, as the full connector loads and saves it (`get(out=)`, `put`);
- `named_*`: 1,920 / page_tokens pages, each its own one-page sequence named by a key (`get_batch(outs=)` straight
  into one staging tensor per page, `put_batch`, `lookup_batch` for exists), as the plug-ins do.

`named_get_vs_prefix_get` and `named_put_vs_prefix_put` are the ratios (1.0: paging costs nothing). Puts are timed
on an emptied cache (the delete is outside the clock), so each writes every block. The engine-level figures
(time to first token against recompute) exist for the path that runs a real engine here, the full connector
(`python -m bench.vllm_connector`); for the plug-ins they are null with the reason: neither engine path runs on
this machine's CPU builds (docs/sglang.md, docs/vllm.md).

Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

PREFIX_CACHE = "c_pages_prefix"
NAMED_CACHE = "c_pages_named"
NAMESPACE = "bench"
NOT_RUN = {
    "sglang_ttft_speedup_vs_recompute": "no SGLang server runs here: the PyPI build targets CUDA and its CPU engine "
    "needs AMX/AVX-512 kernels (docs/sglang.md)",
    "vllm_tier_ttft_speedup_vs_recompute": "vLLM's CPU build refuses the offloading connector's worker "
    "(CPUOffloadingSpec: CUDA-alike and XPU only; docs/vllm.md)",
}


@dataclass(frozen=True)
class PagesConfig:
    rounds: int
    warmup_rounds: int
    ops_per_round: int


QUICK = PagesConfig(rounds=4, warmup_rounds=1, ops_per_round=2)
FULL = PagesConfig(rounds=12, warmup_rounds=2, ops_per_round=4)


def page_keys(num_pages: int) -> list[str]:
    """SGLang-like page keys (hex digests) for the load's pages."""
    import hashlib

    return [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(num_pages)]


def _contenders(prefix, named, tokens, pages, kv, out, page_outs, page_kv) -> dict:
    """name -> (prepare or None, the timed operation)."""
    n, per = len(tokens), len(pages[0])

    def check(found: int, want: int) -> None:
        if found != want:
            raise RuntimeError(f"found {found} of {want} tokens")

    def prefix_get() -> None:
        check(prefix.get(tokens, out=out)[0], n)

    def named_get() -> None:
        for got, _ in named.get_batch(pages, outs=page_outs):
            check(got, per)

    def named_exists() -> None:
        check(sum(named.lookup_batch(pages)), n)

    def prefix_exists() -> None:
        check(prefix.lookup(tokens), n)

    return {
        "prefix_get": (None, prefix_get),
        "named_get": (None, named_get),
        "prefix_put": (lambda: prefix.delete(tokens), lambda: prefix.put(tokens, kv)),
        "named_put": (lambda: named.delete_batch(pages), lambda: named.put_batch(list(zip(pages, page_kv)))),
        "prefix_exists": (None, prefix_exists),
        "named_exists": (None, named_exists),
    }


def _rounds(contenders: dict, cfg: PagesConfig) -> dict[str, list[float]]:
    """Per contender, its wall seconds per operation after the warm-up rounds (each prepared outside the clock)."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(cfg.warmup_rounds + cfg.rounds):
        for name, (prepare, fn) in contenders.items():
            for _ in range(cfg.ops_per_round):
                if prepare is not None:
                    prepare()
                started = time.perf_counter()
                fn()
                if index >= cfg.warmup_rounds:
                    samples[name].append(time.perf_counter() - started)
    return samples


def run(cfg: PagesConfig, mode: str, page_tokens_n: int) -> dict:
    import multiprocessing as mp
    import shutil
    import ssl
    import tempfile

    import numpy as np
    import torch

    from bench._dataplane_node import NodeProcess, make_pki, make_signing, make_token, spec_from
    from bench.hit_cost import PROMPT_TOKENS, hit_fields, load_tokens
    from kcaas.connectors.named_pages import page_tokens
    from kcaas.dataplane import DataPlaneClient

    n = load_tokens()
    if n % page_tokens_n:
        raise SystemExit(f"--page-tokens must divide the load's {n} tokens")
    fields = hit_fields(page_tokens_n)
    spec = spec_from(fields)
    r: dict = {"mode": mode, "cpu_count": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0]}
    r.update(tokens=n, bytes=n * spec.kv_bytes_per_token, page_tokens=page_tokens_n, pages=n // page_tokens_n)
    workdir = tempfile.mkdtemp(prefix="kcaas-bench-pages-")
    pki = make_pki(workdir)
    private, jwks = make_signing()
    caches = {cache: (fields, 256 << 20) for cache in (PREFIX_CACHE, NAMED_CACHE)}
    node = NodeProcess(mp.get_context("spawn"), pki, jwks, workdir, {"caches": caches, "max_frame_bytes": 256 << 20})
    closers = [node.stop]
    try:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        clients = {
            cache: DataPlaneClient(
                node.info["endpoint"], make_token(private, jwks, cache), cache, spec, ssl_context=ctx
            )
            for cache in caches
        }
        closers += [client.close for client in clients.values()]
        prompt = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int32)
        tokens = prompt[:n]
        shape = (spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim)
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        pages = [page_tokens(NAMESPACE, key, page_tokens_n) for key in page_keys(n // page_tokens_n)]
        page_kv = [kv[:, :, i * page_tokens_n : (i + 1) * page_tokens_n].contiguous() for i in range(len(pages))]
        out = torch.zeros_like(kv)
        page_outs = [torch.zeros_like(part) for part in page_kv]
        clients[PREFIX_CACHE].put(tokens, kv)
        clients[NAMED_CACHE].put_batch(list(zip(pages, page_kv)))
        _check_bytes(clients, tokens, kv, out, pages, page_kv, page_outs)
        contenders = _contenders(
            clients[PREFIX_CACHE], clients[NAMED_CACHE], tokens, pages, kv, out, page_outs, page_kv
        )
        samples = _rounds(contenders, cfg)
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(workdir, ignore_errors=True)
    for name, found in samples.items():
        r[f"{name}_ms"] = round(statistics.median(found) * 1e3, 2)
        r[f"{name}_ms_range"] = [round(min(found) * 1e3, 2), round(max(found) * 1e3, 2)]
    for op in ("get", "put", "exists"):
        r[f"named_{op}_vs_prefix_{op}"] = round(r[f"named_{op}_ms"] / r[f"prefix_{op}_ms"], 3)
    r["vllm_connector_ttft"] = "python -m bench.vllm_connector: ttft_speedup_vs_recompute (the full connector)"
    for name, reason in NOT_RUN.items():
        r[name] = None
        r[name.replace("_ttft_speedup_vs_recompute", "_not_run")] = reason
    r["loadavg_1min_at_end"] = os.getloadavg()[0]
    return r


def _check_bytes(clients, tokens, kv, out, pages, page_kv, page_outs) -> None:
    """Both paths hand back exactly the bytes put, before anything is timed."""
    import torch

    got, view = clients[PREFIX_CACHE].get(tokens, out=out)
    answers = clients[NAMED_CACHE].get_batch(pages, outs=page_outs)
    if got != len(tokens) or not torch.equal(view, kv):
        raise RuntimeError("the prefix get returned other bytes than were put")
    if any(n != len(page) or not torch.equal(part, want) for (n, part), page, want in zip(answers, pages, page_kv)):
        raise RuntimeError("a named page came back with other bytes than were put")


def _table(r: dict) -> str:
    head = f"{r['tokens']} tokens, {r['bytes'] / (1 << 20):.1f} MiB, {r['pages']} pages of {r['page_tokens']} tokens"
    rows = [f"{head} ({r['mode']})"]
    for op in ("get", "put", "exists"):
        for side in ("prefix", "named"):
            low, high = r[f"{side}_{op}_ms_range"]
            rows.append(f"  {side}_{op:<8} {r[f'{side}_{op}_ms']:8.2f} ms  [{low:.2f} .. {high:.2f}]")
        rows.append(f"  named_{op}_vs_prefix_{op}: {r[f'named_{op}_vs_prefix_{op}']:.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.named_pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per page (SGLang's default page: 64)")
    args = parser.parse_args(argv)
    r = run(QUICK if args.quick else FULL, "quick" if args.quick else "full", args.page_tokens)
    print(_table(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
