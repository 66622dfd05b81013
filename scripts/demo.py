"""`make demo`: against a running `make up`, attach a KV cache (or reuse the one named "demo") and run a tiny
transformers model (a random-init LlamaForCausalLM, float32, eager attention, built offline) through the SDK's
HFConnector over the TLS 1.3 data plane, on prompts that share a long system prompt. Prints the hit rate (prompt
tokens served from the cache / prompt tokens), the prefill tokens saved, and the time saved against the same prompts
run without the service (both measured here). The cache is left attached: detach it with the SDK's
Client.detach when done.

Configuration: KCAAS_URL (default http://127.0.0.1:8000); KCAAS_API_KEY (default: the demo tenant key `make up`
writes to $KCAAS_VAR_DIR/secrets/demo-api-key); KCAAS_CA_FILE (the CA of the nodes' data-plane certificates; default:
the one the control plane publishes at /.well-known/kcaas-ca.pem, `make up`'s dev CA). KCAAS_VAR_DIR defaults to var/.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_PROMPTS = 6
SYSTEM_TOKENS = 200
QUESTION_TOKENS = 24
NEW_TOKENS = 8
VOCAB = 1000
CACHE_NAME = "demo"


def fail(message: str) -> int:
    print(f"make demo: {message}", file=sys.stderr, flush=True)
    return 1


def main() -> int:
    var_dir = Path(os.environ.get("KCAAS_VAR_DIR", REPO / "var"))
    url = os.environ.get("KCAAS_URL", "http://127.0.0.1:8000")
    api_key = os.environ.get("KCAAS_API_KEY", "").strip()
    key_file = var_dir / "secrets" / "demo-api-key"
    if not api_key:
        if not key_file.exists():
            return fail(f"no API key: set KCAAS_API_KEY, or run `make up` first (it writes {key_file})")
        api_key = key_file.read_text().strip()
    ca_file = os.environ.get("KCAAS_CA_FILE") or None
    if ca_file and not Path(ca_file).exists():
        return fail(f"no CA file at {ca_file}: unset KCAAS_CA_FILE to trust the CA the control plane publishes")

    import torch
    import transformers

    import kcaas
    from kcaas.connectors.hf import HFConnector
    from kcaas.dataplane import DataPlaneError
    from kcaas.errors import KcaasError
    from kcaas.spec import KVCacheSpec

    transformers.logging.set_verbosity_error()
    # One intra-op thread: `make up`'s own processes share these CPUs, and torch's spinning worker threads make both
    # timings noisy under that load (several-fold); with eager attention it also keeps the arithmetic bit-stable.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    spec = KVCacheSpec.from_hf_config(model.config, dtype="float32", model_fingerprint="kcaas-demo-tiny-llama@seed0")

    generator = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (SYSTEM_TOKENS,), generator=generator)
    prompts = [
        torch.cat([system, torch.randint(0, VOCAB, (QUESTION_TOKENS,), generator=generator)])[None]
        for _ in range(NUM_PROMPTS)
    ]
    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)

    try:
        kc = kcaas.connect(url, api_key, ca=ca_file)
        client = kc.client
        existing = [
            cache
            for cache in client.list_caches()
            if cache.name == CACHE_NAME and cache.state in ("pending", "provisioning", "ready")
        ]
        cache = data_plane = None
        for candidate in (c for c in existing if c.spec == spec):
            try:
                data_plane = kc.cache(candidate.id, access="readwrite", spec=spec, ready_timeout=60)
                data_plane.lookup(system)
            except DataPlaneError as error:  # e.g. the node restarted and no longer holds it: replace it
                print(f"cache {candidate.id} is unusable ({error.code}): detaching it", flush=True)
                if data_plane is not None:
                    data_plane.close()
                client.detach(candidate.id, wait=True, timeout=60)
                existing.remove(candidate)
                data_plane = None
                continue
            cache = client.get_cache(candidate.id)
            print(f"reusing cache {cache.name!r} ({cache.id}) on {cache.endpoint}", flush=True)
            break
        if cache is None:
            name = CACHE_NAME if not existing else f"{CACHE_NAME}-{spec.model_fingerprint}"
            print(f"attaching cache {name!r} ...", flush=True)
            cache = client.attach(name, spec, {"device": 16 << 20}, timeout=60)
            print(f"attached {cache.id} on {cache.endpoint}", flush=True)
            data_plane = kc.cache(cache.id, access="readwrite", spec=spec, timeout=30.0)
    except (KcaasError, OSError) as error:
        return fail(f"could not attach a cache through {url}: {error}")

    connector = HFConnector(model, data_plane)

    # Each prompt runs without the service, then through it, back to back: the two timings share the machine's
    # load (make up's own processes run on the same CPUs), so the comparison is fair.
    with torch.no_grad():
        model.generate(prompts[0], **generate)  # warm-up: first-call overheads out of both measurements
    plain, served = [], []
    plain_seconds = served_seconds = 0.0
    prompt_tokens = cached_tokens = 0
    try:
        for prompt in prompts:
            start = time.perf_counter()
            with torch.no_grad():
                plain.append(model.generate(prompt, **generate))
            plain_seconds += time.perf_counter() - start
            start = time.perf_counter()
            served.append(connector.generate(prompt, **generate))
            served_seconds += time.perf_counter() - start
            prompt_tokens += connector.last_reuse.num_prompt_tokens
            cached_tokens += connector.last_reuse.num_cached_tokens
    except (KcaasError, OSError) as error:
        return fail(f"the data plane at {cache.endpoint} failed: {error}")
    finally:
        kc.close()
    same = all(
        torch.equal(p if isinstance(p, torch.Tensor) else p.sequences, s.sequences) for p, s in zip(plain, served)
    )

    saved = plain_seconds - served_seconds
    print(
        f"\nKCaaS demo: {NUM_PROMPTS} prompts sharing a {SYSTEM_TOKENS}-token system prompt "
        f"(+{QUESTION_TOKENS} tokens each), {NEW_TOKENS} new tokens each, tiny random Llama on the CPU\n"
        f"  hit rate             {cached_tokens / prompt_tokens:.1%}   ({cached_tokens} of {prompt_tokens} prompt "
        f"tokens served from the cache)\n"
        f"  prefill tokens saved {cached_tokens}\n"
        f"  time without service {plain_seconds * 1000:.1f} ms\n"
        f"  time with service    {served_seconds * 1000:.1f} ms   (data plane round trips included)\n"
        f"  time saved           {saved * 1000:.1f} ms   ({saved / plain_seconds:.1%})\n"
        f"  same tokens as without the service: {'yes' if same else 'NO'}\n"
        f"the cache {cache.name!r} ({cache.id}) stays attached; detach it with kcaas.Client(...).detach({cache.id!r})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
