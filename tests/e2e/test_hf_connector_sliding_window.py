"""The transformers connector on sliding-window models (Mistral, Qwen2 with use_sliding_window, Gemma 2 and 3, which
mix sliding and full layers), over a real engine store, with prompts several windows long.

The model's own cache keeps only the last window - 1 tokens of a sliding layer; what the connector stores must be
the KV of every token it names, so a later prompt sharing the prefix continues exactly as the model alone does. Also:
KV whose length is not the token count never reaches the store, and a read-only connector decodes over a store
that refuses puts and still returns its output.
"""

import pytest
import torch
import transformers

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector, ReadOnlyStore
from kcaas.dataplane import DataPlaneError
from kcaas.spec import KVCacheSpec
from kcaas.transformers_kv import full_length_cache, kv_from_dynamic_cache
from tests.e2e.conftest import FP32_ROUNDING, model_prefix, random_tokens

pytestmark = pytest.mark.usefixtures("deterministic_threads")  # from tests/e2e/conftest.py

WINDOW = 8
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attn_implementation="eager",
)
FAMILIES = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=WINDOW, **COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, **COMMON)
    ),
    # head_dim 32, not hidden_size // heads = 16: the store's layout must follow the config's head_dim
    "gemma2": lambda: transformers.Gemma2ForCausalLM(  # layer 0 sliding, layer 1 full
        transformers.Gemma2Config(sliding_window=WINDOW, head_dim=32, **COMMON)
    ),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(sliding_window=WINDOW, head_dim=32, **COMMON)
    ),
}
GENERATE = dict(max_new_tokens=6, do_sample=False, output_logits=True)


def alone(model, input_ids, **kwargs):
    """model.generate without the service. The all-ones mask: Gemma's pad id (0) occurs in these random prompts, and
    without a mask generate would take it for padding (the connector never does: a cache entry is every token)."""
    kwargs = {"attention_mask": torch.ones_like(input_ids), **GENERATE, **kwargs}
    return model.generate(input_ids, return_dict_in_generate=True, **kwargs)


def tiny(family: str):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def store_for(model) -> PagedKVCache:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    spec = KVCacheSpec(
        f"tiny-{c.model_type}-random@seed0",
        c.num_hidden_layers,
        c.num_key_value_heads,
        head_dim,
        4,
        "float32",
        "float32",
    )
    return PagedKVCache(spec, hash_key=b"sliding-window-k" * 2, num_blocks=64, device="cpu")


def prompts():
    system = random_tokens(40, seed=3)  # five windows
    first = torch.cat([system, torch.tensor([[5, 6, 7]])], dim=1)
    return first, torch.cat([system, torch.tensor([[9, 8, 7, 6]])], dim=1)


@pytest.fixture(params=sorted(FAMILIES))
def model(request):
    return tiny(request.param)


@torch.no_grad()
def test_the_stored_kv_is_the_kv_of_every_token_it_names(model):
    first, _ = prompts()
    store = store_for(model)
    HFConnector(model, store).forward(first)
    n, kv = store.get(first[0])
    assert n == first.shape[1]
    reference = model(first, cache=full_length_cache(), use_cache=True).cache  # every layer keeps every token
    assert torch.equal(kv, kv_from_dynamic_cache(reference))


@torch.no_grad()
def test_a_prefix_past_the_window_gives_the_logits_of_the_model_alone(model):
    first, second = prompts()
    connector = HFConnector(model, store_for(model))
    connector.forward(first)
    served = connector.forward(second)
    assert connector.last_reuse.num_cached_tokens == 40
    prefix = model_prefix(model, first, 40)  # what the connector stored, made by the model alone
    assert torch.equal(served.logits, model(second[:, 40:], cache=prefix, use_cache=True).logits)
    assert torch.allclose(served.logits, model(second).logits[:, 40:], **FP32_ROUNDING)  # no cache of any kind


@torch.no_grad()
def test_generation_with_reuse_matches_generation_without_the_service(model):
    first, second = prompts()
    connector = HFConnector(model, store_for(model))
    connector.generate(first, **GENERATE)
    assert connector.last_reuse.num_cached_tokens == 0
    served = connector.generate(second, **GENERATE)
    assert connector.last_reuse.num_cached_tokens == 40

    plain = alone(model, second)  # with the model's own sliding cache
    assert torch.equal(served.sequences, plain.sequences)
    # NOTE: while decoding, the model's own sliding layer attends over a window-long key tensor, the connector's
    # full-length one over all keys with the window masked out: the same sum over another length, equal to fp32
    # rounding (measured <= 1.8e-7, logits of ~0.5); a wrong prefix is off by about the logits themselves.
    assert all(torch.allclose(a, b, **FP32_ROUNDING) for a, b in zip(served.logits, plain.logits))
    # and bit for bit against the model alone given the same prefix in a full-length cache
    local = alone(model, second, cache=model_prefix(model, first, 40))
    assert torch.equal(served.sequences, local.sequences)
    assert all(torch.equal(a, b) for a, b in zip(served.logits, local.logits))


@torch.no_grad()
def test_a_prompt_id_equal_to_the_pad_token_is_a_token_not_padding():
    model = tiny("gemma2")
    first, second = prompts()
    assert (second == model.config.pad_token_id).any()
    connector = HFConnector(model, store_for(model))
    connector.forward(first)  # the prefill side runs the model, which knows nothing of padding
    served = connector.generate(second, **GENERATE)  # generate would infer padding from the pad id: not here
    assert connector.last_reuse.num_cached_tokens == 40
    local = alone(model, second, cache=model_prefix(model, first, 40))
    assert torch.equal(served.sequences, local.sequences)
    assert all(torch.equal(a, b) for a, b in zip(served.logits, local.logits))
    full = alone(model, second, cache=full_length_cache())  # every token a token, no cache: to fp32 rounding
    assert torch.equal(served.sequences, full.sequences)
    assert all(torch.allclose(a, b, **FP32_ROUNDING) for a, b in zip(served.logits, full.logits))
    with pytest.raises(ValueError, match="mask"):
        connector.generate(second, attention_mask=(second != model.config.pad_token_id).long(), **GENERATE)


# ---- the length guard ------------------------------------------------------------------------------------------------


class RecordingStore:
    def __init__(self, inner):
        self.inner, self.puts = inner, []

    def get(self, tokens):
        return self.inner.get(tokens)

    def put(self, tokens, kv):
        self.puts.append((len(tokens), kv.shape[2]))
        return self.inner.put(tokens, kv)


@torch.no_grad()
def test_a_sliding_window_cache_is_refused_not_stored_under_the_first_tokens():
    model = tiny("mistral")
    first, _ = prompts()
    own = model(first, use_cache=True).cache  # the model's own cache: the last WINDOW - 1 tokens per layer
    assert own.layers[0].keys.shape[2] == WINDOW - 1
    store = RecordingStore(store_for(model))
    with pytest.raises(ValueError, match="sliding"):
        HFConnector(model, store).store_sequence(first[0], own)
    assert store.puts == [] and store.inner.lookup(first[0]) == 0


@torch.no_grad()
def test_kv_whose_length_is_not_the_token_count_never_reaches_the_store():
    model = tiny("mistral")
    first, _ = prompts()
    cache = model(first, cache=full_length_cache(), use_cache=True).cache
    store = RecordingStore(store_for(model))
    connector = HFConnector(model, store)
    for tokens in (first[0, :-1], torch.cat([first[0], torch.tensor([1])])):
        with pytest.raises(ValueError, match="tokens"):
            connector.store_sequence(tokens, cache)
    with pytest.raises(ValueError, match="tokens"):
        kv_from_dynamic_cache(cache, num_tokens=first.shape[1] + 1)
    assert store.puts == []
    connector.store_sequence(first[0], cache)
    assert store.puts == [(first.shape[1], first.shape[1])]


# ---- read-only connectors --------------------------------------------------------------------------------------------


class RefusingStore:
    """Serves gets from `inner` and refuses every put, as the data plane does for a read-only token."""

    def __init__(self, inner, *, read_only: bool | None = None):
        self.inner = inner
        if read_only is not None:
            self.read_only = read_only

    def get(self, tokens):
        return self.inner.get(tokens)

    def put(self, tokens, kv):
        raise DataPlaneError("a read-only token cannot put", code="forbidden")


@torch.no_grad()
def test_a_read_only_connector_decodes_without_storing_and_returns_its_output():
    model = tiny("gemma2")
    first, second = prompts()
    shared = store_for(model)
    HFConnector(model, shared).forward(first)  # the prefill side, with write access
    with pytest.raises(DataPlaneError):  # what a read token gets without read_only: the generated output is lost
        HFConnector(model, RefusingStore(shared)).generate(second, **GENERATE)

    decoder = HFConnector(model, RefusingStore(shared), read_only=True)
    served = decoder.generate(second, **GENERATE)
    assert decoder.last_reuse.num_cached_tokens == 40
    local = alone(model, second, cache=model_prefix(model, first, 40))
    assert torch.equal(served.sequences, local.sequences)
    assert all(torch.equal(a, b) for a, b in zip(served.logits, local.logits))
    assert decoder.forward(second).logits.shape[1] == second.shape[1] - 40
    with pytest.raises(ValueError, match="read-only"):
        decoder.store_sequence(second[0], full_length_cache())
    assert shared.lookup(second[0]) == 40  # nothing of the decoder's was stored


def test_a_connector_not_told_it_is_read_only_refuses_a_read_only_store_at_once():
    """Read-only is said, never guessed: over a store that refuses puts, a connector that would store raises at
    construction, naming both ways out, rather than going read-only and never caching without a word."""
    model = tiny("mistral")
    for refused in (dict(), dict(read_only=False)):
        with pytest.raises(ReadOnlyStore, match="access='readwrite'.*read_only=True"):
            HFConnector(model, RefusingStore(store_for(model), read_only=True), **refused)
    assert HFConnector(model, RefusingStore(store_for(model), read_only=True), read_only=True).read_only
    assert not HFConnector(model, store_for(model)).read_only
