"""SGLang's HiCache storage interface (the installed sglang's HiCacheStorage, HiCacheStorageConfig and
StorageBackendFactory, in .venv-sglang: tests/e2e/sglang_support.py) over the real service through
kcaas.connectors.sglang.KCaaSHiCacheStorage: the live control plane, a node agent process with its TLS data plane,
tenants and keys. Each runner is a fresh SGLang-side process; its host pool is the stand-in of
tests/e2e/sglang_host_pool.py (SGLang's own zero-copy pointer functions over a pool of each layout).

- pages set by one process come back byte-identical in a fresh one, into other host slots: MHA layer_first (a K and
  a V region per layer) and page_first (a K and a V region) through one staging copy, MLA page_first (one region)
  in place, and the tensor path (batch_set / batch_get of flat pages); exists counts the leading pages held;
- another tenant, with a cache of the same name and layout, finds nothing and reads nothing;
- MLA: two TP ranks, one copy: the non-writer rank writes nothing, reads the writer's pages; MHA: each rank its own;
- errors: a cache of another layout, or of blocks larger than SGLang's pages, refuses at start (SGLang does not
  start); the node killed: exists 0, gets False and the host pages untouched, sets False, each within the I/O
  timeout, never an exception into SGLang.
"""

from __future__ import annotations

import pytest

from kcaas.connectors.named_pages import page_tokens
from kcaas.spec import KVCacheSpec
from tests.e2e.sglang_support import (
    PAGE_SIZE,
    RunnerFailed,
    backend_extra,
    job,
    mha_pool,
    mha_spec,
    mla_pool,
    mla_spec,
    run_sglang,
    sglang_python,
)
from tests.e2e.vllm_support import tenants, vllm_agent, vllm_agent_launcher  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db(transaction=True)]

KEYS = [f"{i:064x}" for i in (11, 22, 33, 44)]  # SGLang's page hashes are hex strings
UNKNOWN = "f" * 64


@pytest.fixture(autouse=True)
def _sglang():
    sglang_python()  # skips (before the live server starts) when the SGLang venv is not given


def by_op(answers: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for answer in answers:
        found.setdefault(answer["op"], []).append(answer)
    return found


@pytest.mark.parametrize(
    "pool, spec, is_mla",
    [
        (mha_pool("layer_first"), mha_spec(), False),
        (mha_pool("page_first"), mha_spec(), False),
        (mla_pool("page_first"), mla_spec(), True),
    ],  # fmt: skip
    ids=["mha-layer_first", "mha-page_first", "mla-page_first"],
)
def test_pages_set_in_one_process_come_back_identical_in_a_fresh_one(
    pool, spec, is_mla, live_server, pki, vllm_agent, tenants
):
    a = tenants()
    a.attach("hicache", spec)
    extra = backend_extra(live_server.url, "hicache", pki)
    steps = [
        {"op": "fill", "seed": 7},
        {"op": "set_v1", "keys": KEYS, "pages": [0, 1, 2, 3]},
        {"op": "exists", "keys": KEYS + [UNKNOWN]},
        {"op": "set_flat", "keys": ["flat-" + k for k in KEYS[:2]], "pages": [4, 5]},
    ]
    written = by_op(run_sglang(job(extra, pool, steps, is_mla=is_mla), a.key))
    digests = written["fill"][0]["digests"]
    assert written["set_v1"][0]["ok"] == [True] * 4
    assert written["exists"][0]["count"] == 4 and written["exists"][0]["each"] == [True] * 4 + [False]
    assert written["set_flat"][0]["ok"] is True

    steps = [
        {"op": "exists", "keys": [KEYS[0], KEYS[1], UNKNOWN, KEYS[2]]},
        {"op": "get_v1", "keys": KEYS, "pages": [7, 6, 5, 4]},  # other slots, in another order
        {"op": "digest", "pages": [7, 6, 5, 4]},
        {"op": "get_flat", "keys": ["flat-" + k for k in KEYS[:2]] + ["flat-" + UNKNOWN]},
        {"op": "stats"},
    ]
    fresh = by_op(run_sglang(job(extra, pool, steps, is_mla=is_mla), a.key))
    assert fresh["exists"][0]["count"] == 2  # the leading pages held, up to the first miss
    assert fresh["get_v1"][0]["ok"] == [True] * 4
    assert fresh["digest"][0]["digests"] == digests[:4]
    assert fresh["get_flat"][0]["digests"] == [digests[4], digests[5], None]
    assert fresh["stats"][0]["pages_read"] == 6 and fresh["stats"][0]["pages_missed"] == 1


def test_another_tenant_with_the_same_cache_name_finds_nothing(live_server, pki, vllm_agent, tenants):
    a, b = tenants(), tenants()
    a.attach("hicache", mha_spec())
    b.attach("hicache", mha_spec())  # B's own cache, by the same name and layout
    extra = backend_extra(live_server.url, "hicache", pki)
    seed = [{"op": "fill", "seed": 3}, {"op": "set_v1", "keys": KEYS, "pages": [0, 1, 2, 3]}]
    seeded = by_op(run_sglang(job(extra, mha_pool(), seed), a.key))
    assert seeded["set_v1"][0]["ok"] == [True] * 4

    steps = [
        {"op": "exists", "keys": KEYS},
        {"op": "get_v1", "keys": KEYS, "pages": [0, 1, 2, 3]},
        {"op": "digest", "pages": [0, 1, 2, 3]},
    ]
    other = by_op(run_sglang(job(extra, mha_pool(), steps), b.key))
    assert other["exists"][0]["count"] == 0
    assert other["get_v1"][0]["ok"] == [False] * 4
    zero_page = other["digest"][0]["digests"][0]
    assert other["digest"][0]["digests"] == [zero_page] * 4 and zero_page not in seeded["fill"][0]["digests"]


def test_mla_ranks_share_one_copy_and_mha_ranks_keep_their_own(live_server, pki, vllm_agent, tenants):
    a = tenants()
    mla_cache = a.attach("mla", mla_spec())
    a.attach("mha", mha_spec())
    mla, mha = backend_extra(live_server.url, "mla", pki), backend_extra(live_server.url, "mha", pki)
    write = [{"op": "fill", "seed": 5}, {"op": "set_v1", "keys": KEYS, "pages": [0, 1, 2, 3]}, {"op": "stats"}]

    rank1 = by_op(run_sglang(job(mla, mla_pool(), write, is_mla=True, tp_rank=1, tp_size=2), a.key))
    assert rank1["set_v1"][0]["ok"] == [True] * 4  # as SGLang's backup_skip: the writer rank stores the copy
    assert rank1["stats"][0]["pages_written"] == 0
    rank0 = by_op(run_sglang(job(mla, mla_pool(), write, is_mla=True, tp_rank=0, tp_size=2), a.key))
    assert rank0["stats"][0]["pages_written"] == 4
    read = [{"op": "get_v1", "keys": KEYS, "pages": [4, 5, 6, 7]}, {"op": "digest", "pages": [4, 5, 6, 7]}]
    reader = by_op(run_sglang(job(mla, mla_pool(), read, is_mla=True, tp_rank=1, tp_size=2), a.key))
    assert reader["get_v1"][0]["ok"] == [True] * 4
    assert reader["digest"][0]["digests"] == rank0["fill"][0]["digests"][:4]
    # one copy: the pages are held under the one MLA name, and under no per-rank name
    dp = a.data_plane(mla_cache)
    one = [page_tokens("sglang", f"page_first/mla/v1/{k}", PAGE_SIZE) for k in KEYS]
    per_rank = [page_tokens("sglang", f"page_first/tp{r}of2/v1/{k}", PAGE_SIZE) for k in KEYS for r in (0, 1)]
    assert dp.lookup_batch(one) == [PAGE_SIZE] * 4 and dp.lookup_batch(per_rank) == [0] * 8

    for rank, seed in ((0, 1), (1, 2)):  # MHA: each rank writes its own heads under the same page keys
        steps = [{"op": "fill", "seed": seed}, {"op": "set_v1", "keys": KEYS[:2], "pages": [0, 1]}]
        assert (
            by_op(run_sglang(job(mha, mha_pool(), steps, tp_rank=rank, tp_size=2), a.key))["set_v1"][0]["ok"]
            == [True] * 2
        )
    for rank, seed in ((0, 1), (1, 2)):
        steps = [
            {"op": "fill", "seed": seed},
            {"op": "digest", "pages": [0, 1]},
            {"op": "zero"},
            {"op": "get_v1", "keys": KEYS[:2], "pages": [0, 1]},
            {"op": "digest", "pages": [0, 1]},
        ]
        got = by_op(run_sglang(job(mha, mha_pool(), steps, tp_rank=rank, tp_size=2), a.key))
        assert got["get_v1"][0]["ok"] == [True] * 2
        assert got["digest"][1]["digests"] == got["digest"][0]["digests"]  # its own rank's bytes


def test_a_cache_of_another_layout_refuses_at_start(live_server, pki, vllm_agent, tenants):
    a = tenants()
    a.attach("hicache", mha_spec())
    a.attach("coarse", KVCacheSpec(**{**mha_spec().to_dict(), "block_size": 8}))  # blocks larger than SGLang's pages
    with pytest.raises(RunnerFailed) as failed:
        run_sglang(job(backend_extra(live_server.url, "hicache", pki), mla_pool(), [], is_mla=True), a.key)
    assert "ConnectorSetupError: KCaaS connector: cache 'hicache' was attached for another KV layout" in (
        failed.value.stderr
    )
    with pytest.raises(RunnerFailed) as failed:
        run_sglang(job(backend_extra(live_server.url, "coarse", pki), mha_pool(), []), a.key)
    assert "block_size 8, which does not divide SGLang's --page-size 4" in failed.value.stderr


def test_a_node_that_is_gone_makes_misses_and_failed_sets_without_waiting(live_server, pki, vllm_agent, tenants):
    a = tenants()
    a.attach("hicache", mha_spec())
    extra = backend_extra(live_server.url, "hicache", pki, io_timeout_s=2)
    seed = [{"op": "fill", "seed": 9}, {"op": "set_v1", "keys": KEYS, "pages": [0, 1, 2, 3]}]
    seeded = by_op(run_sglang(job(extra, mha_pool(), seed), a.key))
    assert seeded["set_v1"][0]["ok"] == [True] * 4
    vllm_agent.kill()

    steps = [
        {"op": "zero"},
        {"op": "exists", "keys": KEYS},
        {"op": "get_v1", "keys": KEYS, "pages": [0, 1, 2, 3]},
        {"op": "digest", "pages": [0, 1, 2, 3]},
        {"op": "set_v1", "keys": [UNKNOWN], "pages": [4]},
        {"op": "stats"},
    ]
    gone = by_op(run_sglang(job(extra, mha_pool(), steps), a.key))
    assert gone["exists"][0]["count"] == 0 and gone["exists"][0]["each"] == [False] * 4
    assert gone["get_v1"][0]["ok"] == [False] * 4
    zero_page = gone["digest"][0]["digests"][0]
    assert gone["digest"][0]["digests"] == [zero_page] * 4  # nothing landed in the host pool
    assert gone["set_v1"][0]["ok"] == [False]
    assert gone["stats"][0]["pages_missed"] == 4 and gone["stats"][0]["pages_failed_to_write"] == 1
    slowest = max(answer["elapsed_s"] for op in ("exists", "get_v1", "set_v1") for answer in gone[op])
    assert slowest < 2 * 2 + 1, gone  # a refused connection is immediate; a hung one costs io_timeout_s per request
