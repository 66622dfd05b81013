"""kcaas.connectors.sglang_pages without SGLang: the backend's configuration from SGLang's extra config, and which
engines' pages share names (tests/e2e/test_sglang_hicache.py runs the backend through SGLang itself)."""

from __future__ import annotations

import pytest

from kcaas.connectors.named_pages import page_tokens
from kcaas.connectors.sglang_pages import HiCacheConfig, PageStore, page_namespace
from kcaas.connectors.vllm_session import ConnectorSetupError

SGLANG_OWN = {"backend_name": "kcaas", "module_path": "kcaas.connectors.sglang", "class_name": "X", "interface_v1": 1}


def test_sglangs_own_keys_are_passed_over_and_ours_read():
    config = HiCacheConfig.from_extra(
        {**SGLANG_OWN, "kcaas_url": "https://cp", "cache": "chat", "io_timeout_s": "2.5", "ca_file": "ca.pem"},
        environ={},
    )
    assert config == HiCacheConfig(url="https://cp", cache="chat", ca_file="ca.pem", io_timeout_s=2.5)


def test_the_url_falls_back_to_kcaas_url_in_the_environment():
    config = HiCacheConfig.from_extra({**SGLANG_OWN, "cache": "chat"}, environ={"KCAAS_URL": "https://env"})
    assert config.url == "https://env" and config.api_key_env == "KCAAS_API_KEY"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"kcaas_url": "https://cp", "cache": "chat", "cach": "x"}, "unknown hicache extra config keys ['cach']"),
        ({"cache": "chat"}, "no control-plane URL"),
        ({"kcaas_url": "https://cp"}, "cache (the cache's id or name) is required"),
        ({"kcaas_url": "https://cp", "cache": "chat", "io_timeout_s": "soon"}, "wrong type"),
    ],
)
def test_a_bad_extra_config_is_refused_with_what_to_change(extra, message):
    with pytest.raises(ConnectorSetupError, match="KCaaS connector: ") as refused:
        HiCacheConfig.from_extra({**SGLANG_OWN, **extra}, environ={})
    assert message in str(refused.value)


def names(**overrides) -> str:
    shape = dict(layout="page_first", is_mla=False, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, cp_rank=0, cp_size=1)
    return page_namespace(**{**shape, **overrides})


def test_mla_pages_have_one_name_for_every_tp_rank_and_mha_pages_one_per_rank():
    assert names(is_mla=True, tp_rank=0) == names(is_mla=True, tp_rank=1) == "page_first/mla"
    assert names(tp_rank=0) == "page_first/tp0of2" and names(tp_rank=1) == "page_first/tp1of2"


def test_layouts_pipeline_stages_and_cp_ranks_never_share_names():
    every = {
        names(),
        names(layout="layer_first"),
        names(pp_rank=0, pp_size=2),
        names(pp_rank=1, pp_size=2),
        names(cp_rank=1, cp_size=2),
        names(is_mla=True),
        names(is_mla=True, pp_rank=1, pp_size=2),
    }
    assert len(every) == 7


def test_a_pages_tokens_are_the_named_page_of_its_namespace_and_key():
    store = PageStore(None, None, None, "page_first/mla/v1", page_size=16)
    assert bytes(store.tokens("ab12")) == bytes(page_tokens("sglang", "page_first/mla/v1/ab12", 16))
    assert bytes(store.tokens("ab12")) != bytes(PageStore(None, None, None, "page_first/tp0of2/v1", 16).tokens("ab12"))
    assert store.exists_prefix([]) == 0 and store.put([], []) == [] and store.get([], []) == []
