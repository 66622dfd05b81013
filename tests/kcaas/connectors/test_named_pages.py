"""Named pages' token ids: deterministic, apart per namespace and key, valid int32 ids of the asked length."""

from __future__ import annotations

import pytest

from kcaas.connectors.named_pages import page_tokens


def test_the_same_key_gives_the_same_ids_and_other_keys_or_namespaces_other_ids():
    ids = page_tokens("sglang", "a1b2", 64).tolist()
    assert ids == page_tokens("sglang", b"a1b2", 64).tolist()
    assert len(ids) == 64 and all(0 <= i < 2**31 for i in ids)
    assert len(set(ids)) > 60  # not a constant fill
    others = [
        page_tokens("sglang", "a1b3", 64),
        page_tokens("vllm-tier", "a1b2", 64),
        page_tokens("sglan", "ga1b2", 64),
    ]
    assert all(other.tolist() != ids for other in others)
    assert page_tokens("sglang", "a1b2", 16).tolist() == ids[:16]  # a shorter page: a prefix of the same stream


@pytest.mark.parametrize("namespace,key,n", [("", "k", 4), ("ns", "", 4), ("ns", b"", 4), ("ns", "k", 0)])
def test_an_empty_namespace_or_key_or_no_tokens_is_refused(namespace, key, n):
    with pytest.raises(ValueError):
        page_tokens(namespace, key, n)
