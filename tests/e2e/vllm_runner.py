"""A real vLLM engine for the e2e tests, run by the vLLM venv's interpreter (KCAAS_VLLM_PYTHON, `make vllm-venv`),
never imported by the main venv's pytest (its name is not test_*, and it imports vLLM only inside the subcommands).

    $KCAAS_VLLM_PYTHON tests/e2e/vllm_runner.py build-model --arch llama|qwen2|deepseek_v3 --out DIR
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_runner.py generate < job.json
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_runner.py probe-layout
    $KCAAS_VLLM_PYTHON tests/e2e/vllm_runner.py probe-mla-layout

`build-model` saves a tiny random-init model (seed 0, float32) with vLLM's own transformers: head_dim 32, the
smallest the CPU attention backend takes (deepseek_v3: MLA with the 512 + 64 latent, the only width vLLM's CPU MLA
backend takes); weights ten times the usual init scale, so greedy picks are clear (the default init gives
near-uniform logits, top-2 a few 1e-3 apart).

`generate` reads ONE JSON line from stdin, the job:

    {"model": DIR, "dtype": "float32", "max_model_len": 1024,
     "kv_role": null | "kv_both" | "kv_producer" | "kv_consumer",      # null: no connector (the baseline)
     "extra_config": {...},                                           # kv_connector_extra_config
     "connector": "KCaaSConnector", "connector_module": "kcaas.connectors.vllm",
     "enable_prefix_caching": false, "logprobs": null | k,            # k: the top-k logprobs of each step too
     "multiprocess": true,            # false: engine core and worker in this process (starts ~25 s sooner)
     "kv_cache_memory_bytes": N, "max_num_batched_tokens": N, "max_num_seqs": N,       # optional engine sizes
     "block_size": N,                                                 # vLLM's block size (CPU default: 128)
     "custom_ops": ["-rotary_embedding"],                             # optional compilation_config custom_ops
     "attention_backend": "CPU_MLA",                                  # optional: vLLM's choice otherwise
     "start_paused": false, "pause_between_rounds": false,
     "rounds": [{"prompts": [[ids]], "max_tokens": N}, ...]}          # or "prompts" + "max_tokens": one round

and prints JSON lines on stdout, nothing else (vLLM's own output, and its child processes', goes to stderr):
`{"ready": true}` once the engine is up when `start_paused` (then it waits for a line "next" on stdin), after
every round but the last `{"round": i, ...result}` (with `pause_between_rounds` it waits for "next" again: a
test acts between rounds, kills the node, lets a token expire), and last the last round's result:

    {"outputs": [[ids]], "num_cached_tokens": [...], "external_hits": {"queries", "hits"} | null,
     "connector_stats": [{...}, ...], "elapsed_s": ..., "logprobs": [[{token: logprob}]] (if asked)}

Then it exits when stdin closes (so a test can hold the engine while its async saves land); greedy, ignore_eos.

`num_cached_tokens` is vLLM's per-request count of prompt tokens it did not compute (local prefix cache + what the
connector promised; the tests run without vLLM's prefix cache, so it is the external hit). `external_hits` sums
vLLM's connector prefix-cache stats (queries and hits, in tokens) over the round, `connector_stats` lists the
connector's own per-step stats payloads (KVConnectorStats.data) as vLLM collected them.

If the engine does not start (or a round fails) it exits 1, the exception's type and message on the last line of
stderr.

`probe-layout` runs the CPU attention backend's own cache write (`cpu_attn_reshape_and_cache`, with the ISA the
backend picks for each dtype, block size and head size) and prints one JSON line per case: whether the connector's
probed layout reads back exactly the K and V the kernel was given, and whether the layout the backend's Python view
suggests would have (`view_reads_k`, `view_reads_v`).

`probe-mla-layout` does the same for the CPU MLA backend's latent rows (`probed_reads_rows`, `view_reads_rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def build_model(arch: str, out: str) -> None:
    import torch
    import transformers

    common = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )  # sharp logits: clear greedy picks
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)  # GQA, with q/k/v biases
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "deepseek_v3":
        config = _deepseek_v3_config(transformers, common)
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        raise SystemExit(f"unknown arch {arch!r} (llama, qwen2, deepseek_v3)")
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    if arch == "qwen2":
        with torch.no_grad():  # random-init biases start at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(out)
    print(json.dumps({"model": out, "arch": arch}))


def _deepseek_v3_config(transformers, common: dict):
    """A tiny DeepSeek-V3 (MLA, dense layers only): the latent is 512 + 64 wide, the only width vLLM's CPU MLA
    decode kernel takes; no q LoRA, no MoE layer (first_k_dense_replace = layers), no MTP layer."""
    mla = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}
    return transformers.DeepseekV3Config(
        **{**mla, "hidden_size": 256, "intermediate_size": 512},
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        num_nextn_predict_layers=0,
        rope_scaling=None,
    )


class _StatsTap:
    """Collects the SchedulerStats vLLM's engine hands its output processor after each step (log stats on)."""

    def __init__(self, llm):
        self.connector_stats: list[dict] = []
        self.queries = self.hits = 0
        self.seen = False
        processor = llm.llm_engine.output_processor
        original = processor.update_scheduler_stats

        def update(stats):
            if stats is not None:
                self.record(stats)
            return original(stats)

        processor.update_scheduler_stats = update

    def record(self, stats) -> None:
        payload = getattr(stats, "kv_connector_stats", None)
        if payload:
            self.connector_stats.append(_jsonable(payload))
        prefix = getattr(stats, "connector_prefix_cache_stats", None)
        if prefix is not None:
            self.seen = True
            self.queries += int(getattr(prefix, "queries", 0) or 0)
            self.hits += int(getattr(prefix, "hits", 0) or 0)

    def take(self) -> dict:
        result = {
            "external_hits": {"queries": self.queries, "hits": self.hits} if self.seen else None,
            "connector_stats": self.connector_stats,
        }
        self.connector_stats, self.queries, self.hits = [], 0, 0
        return result


def _jsonable(value):
    return json.loads(json.dumps(value, default=repr))


def generate(job: dict, proto, commands) -> None:
    if not job.get("multiprocess", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (before vLLM loads)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 1024),
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=job.get("enable_prefix_caching", False),
        disable_log_stats=False,
    )
    for name in ("kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs", "block_size", "attention_backend"):
        if job.get(name) is not None:
            kwargs[name] = job[name]
    if job.get("custom_ops"):  # e.g. ["-rotary_embedding"]: vLLM's torch ops instead of those custom kernels
        kwargs["compilation_config"] = {"custom_ops": list(job["custom_ops"])}
    if not job.get("multiprocess", True):
        kwargs["distributed_executor_backend"] = "uni"  # the worker in this process too
    if job.get("kv_role"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=job.get("connector", "KCaaSConnector"),
            kv_connector_module_path=job.get("connector_module", "kcaas.connectors.vllm"),
            kv_role=job["kv_role"],
            kv_connector_extra_config=job.get("extra_config", {}),
        )
    llm = LLM(**kwargs)
    tap = _StatsTap(llm)

    def emit(message: dict) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    def wait_for_go() -> None:
        if commands.readline().strip() != "next":
            raise SystemExit("stdin closed while waiting for the next round")

    if job.get("start_paused"):
        emit({"ready": True})
        wait_for_go()
    rounds = job.get("rounds") or [{"prompts": job["prompts"], "max_tokens": job.get("max_tokens", 8)}]
    for i, spec in enumerate(rounds):
        params = SamplingParams(
            temperature=0,
            max_tokens=spec.get("max_tokens", 8),
            detokenize=False,
            ignore_eos=True,
            logprobs=job.get("logprobs"),
        )
        started = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]], params, use_tqdm=False)
        result = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "elapsed_s": round(time.monotonic() - started, 3),
            **tap.take(),
        }
        if job.get("logprobs") is not None:  # per request, per step: {token id: logprob} of the top ones
            result["logprobs"] = [
                [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs
            ]
        if i < len(rounds) - 1:
            emit({"round": i, **result})
            if job.get("pause_between_rounds"):
                wait_for_go()
        else:
            emit(result)
    commands.readline()  # a test holding this engine (its async saves still in flight) closes stdin to end it


PROBE_CASES = [  # (dtype, block size, head size, kv heads): vec (block % 32 == 0) and vec16 ISAs, odd head counts
    (dtype, block_size, head_size, heads)
    for dtype in ("float32", "bfloat16", "float16")
    for block_size, head_size, heads in ((32, 32, 2), (128, 32, 3), (16, 64, 1), (32, 80, 2), (128, 128, 8))
]


def probe_layout() -> None:
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kcaas.connectors.vllm_blocks import PagedLayout, gather

    for dtype_name, block_size, head_size, heads in PROBE_CASES:
        dtype = getattr(torch, dtype_name)
        isa = _get_attn_isa(dtype, block_size, head_size)

        def write(paged, key, value, slots, isa=isa):
            num_blocks, num_heads, bs, _ = paged.shape
            key_cache, value_cache = paged.view(num_blocks, num_heads, bs * 2, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

        layer = torch.full((5, heads, block_size, 2 * head_size), float("nan"), dtype=dtype)
        probed = PagedLayout.probed("cpu", layer, write)
        generator = torch.Generator().manual_seed(block_size * head_size + heads)
        key, value = (torch.randn(3 * block_size, heads, head_size, generator=generator).to(dtype) for _ in "kv")
        blocks = [4, 0, 2]  # out of order, not contiguous
        slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
        write(layer, key, value, slots)
        read = gather([layer], probed, blocks)[0]
        viewed = gather([layer], PagedLayout.of("cpu", layer), blocks)[0]
        case = {"dtype": dtype_name, "block_size": block_size, "head_size": head_size, "heads": heads, "isa": isa}
        print(
            json.dumps(
                {
                    **case,
                    "probed_reads_k": bool(torch.equal(read[0], key)),
                    "probed_reads_v": bool(torch.equal(read[1], value)),
                    "view_reads_k": bool(torch.equal(viewed[0], key)),
                    "view_reads_v": bool(torch.equal(viewed[1], value)),
                }
            ),
            flush=True,
        )


def probe_mla_layout() -> None:
    """The CPU MLA backend's own cache write (CPUMLAImpl.do_kv_cache_update) read back through the layout the
    connector probes from it, and through the latent view: one JSON line per dtype."""
    import types

    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from kcaas.connectors.vllm import _latent_cache_write
    from kcaas.connectors.vllm_blocks import PagedLayout, gather

    rank, rope, block_size = 512, 64, 16
    impl = CPUMLAImpl.__new__(CPUMLAImpl)  # do_kv_cache_update reads nothing of the instance but the rank it is given
    impl.kv_lora_rank = rank
    for dtype_name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, dtype_name)
        layer = torch.full((5, 1, block_size, rank + rope), float("nan"), dtype=dtype)
        probed = PagedLayout.probed("latent", layer, _latent_cache_write(types.SimpleNamespace(impl=impl)))
        generator = torch.Generator().manual_seed(rank + rope)
        kv_c = torch.randn(3 * block_size, rank, generator=generator).to(dtype)
        k_pe = torch.randn(3 * block_size, 1, rope, generator=generator).to(dtype)
        blocks = [4, 0, 2]
        slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
        impl.do_kv_cache_update(kv_c, k_pe, layer, slots, "auto", torch.ones(1))
        rows = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
        read, viewed = (gather([layer], paged, blocks)[0] for paged in (probed, PagedLayout.of("latent", layer)))
        print(
            json.dumps(
                {
                    "backend": "CPU_MLA",
                    "dtype": dtype_name,
                    "probed_reads_rows": bool(torch.equal(torch.cat([read[0, :, 0], read[1, :, 0]], -1), rows)),
                    "view_reads_rows": bool(torch.equal(torch.cat([viewed[0, :, 0], viewed[1, :, 0]], -1), rows)),
                }
            ),
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm_runner")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model")
    build.add_argument("--arch", choices=["llama", "qwen2", "deepseek_v3"], required=True)
    build.add_argument("--out", required=True)
    sub.add_parser("generate")
    sub.add_parser("probe-layout")
    sub.add_parser("probe-mla-layout")
    args = parser.parse_args(argv)
    if args.command == "build-model":
        build_model(args.arch, args.out)
        return 0
    if args.command == "probe-layout":
        probe_layout()
        return 0
    if args.command == "probe-mla-layout":
        probe_mla_layout()
        return 0

    # stdout carries only this script's JSON lines: vLLM (and the processes it starts, which inherit fd 1) log to
    # stderr instead
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    commands = sys.stdin
    job = json.loads(commands.readline())
    try:
        generate(job, proto, commands)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not isinstance(exc.code, str):
            raise
        traceback.print_exc()
        causes, seen = [], exc
        while seen is not None and len(causes) < 5:
            causes.append(f"{type(seen).__name__}: {seen}")
            seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
        print("vllm_runner: error: " + " <- ".join(causes).replace("\n", " "), file=sys.stderr, flush=True)
        _exit(1)  # vLLM's shutdown hooks can block on a half-started engine
    proto.close()
    _exit(0)


def _exit(status: int) -> None:
    """Exit now, without vLLM's slow teardown: the engine core process (multiprocess mode) is killed first."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
