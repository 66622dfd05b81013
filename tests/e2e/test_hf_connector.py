"""The transformers connector over a real engine store: generating twice with a shared system prompt, the second
run reuses the cached prefix and produces exactly the tokens and logits of a run without any cache service."""

import pytest
import torch

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector
from tests.e2e.conftest import FP32_ROUNDING, model_prefix, spec_for

pytestmark = pytest.mark.usefixtures("deterministic_threads")  # the model fixture comes from tests/e2e/conftest.py


def store_for(model) -> PagedKVCache:
    return PagedKVCache(spec_for(model), hash_key=b"connector-test-k" * 2, num_blocks=64, device="cpu")


def prompt(system: torch.Tensor, user: list[int]) -> torch.Tensor:
    return torch.cat([system, torch.tensor([user])], dim=1)


def test_second_generation_hits_and_matches_a_run_without_the_service(model):
    system = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    first, second = prompt(system, [5, 6, 7]), prompt(system, [9, 8, 7, 6])
    connector = HFConnector(model, store_for(model))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True)

    connector.generate(first, **kwargs)
    assert connector.last_reuse.num_cached_tokens == 0
    served = connector.generate(second, **kwargs)
    assert connector.last_reuse.num_cached_tokens == 40  # the shared system prompt, not recomputed

    with torch.no_grad():
        local = model.generate(second, cache=model_prefix(model, first, 40), return_dict_in_generate=True, **kwargs)
        plain = model.generate(second, return_dict_in_generate=True, **kwargs)
    assert torch.equal(served.sequences, local.sequences)  # the model given the same prefix: bit for bit
    assert all(torch.equal(a, b) for a, b in zip(served.logits, local.logits))
    assert torch.equal(served.sequences, plain.sequences)  # no cache at all: the same tokens, logits to fp32 rounding
    assert all(torch.allclose(a, b, **FP32_ROUNDING) for a, b in zip(served.logits, plain.logits))


def test_a_repeated_prompt_runs_only_its_last_token(model):
    tokens = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(4))
    connector = HFConnector(model, store_for(model))
    connector.forward(tokens)
    output = connector.forward(tokens)
    assert connector.last_reuse.num_cached_tokens == 20 and output.logits.shape[1] == 1
    with torch.no_grad():
        local = model(tokens[:, :20], use_cache=True).cache  # the same shapes without the service: bit-equal
        incremental = model(tokens[:, 20:], cache=local, use_cache=True).logits
        full = model(tokens).logits[:, -1:]
    assert torch.equal(output.logits, incremental)
    # NOTE: against one 21-row forward, a 1-row matmul takes another BLAS path: equal to fp32 rounding only.
    assert torch.allclose(output.logits, full, rtol=0, atol=1e-5)


def test_batches_are_refused(model):
    with pytest.raises(ValueError):
        HFConnector(model, store_for(model)).generate(torch.zeros(2, 4, dtype=torch.long))
