"""bench.routing's trace and its upper bound (bench/_routing_trace.py): the Mooncake trace's fields, conversations
that grow turn by turn, what any router could reuse, and policies that share no content."""

from bench import routing
from bench._routing_trace import BLOCK_TOKENS, make_trace, reusable_tokens, token_ids


def test_the_trace_is_mooncake_shaped_and_each_turn_extends_its_conversation():
    trace = make_trace(conversations=4, turns=3, system_prompts=2, system_blocks=16)
    assert len(trace) == 12 and {"timestamp", "input_length", "output_length", "hash_ids"} <= set(trace[0])
    by_conversation: dict[int, list[dict]] = {}
    for request in trace:
        assert len(request["hash_ids"]) == -(-request["input_length"] // BLOCK_TOKENS)
        by_conversation.setdefault(request["conversation"], []).append(request)
    for turns in by_conversation.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later["hash_ids"][: len(earlier["hash_ids"])] == earlier["hash_ids"]
    first_turn = sorted(by_conversation.items())
    systems = [turns[0]["hash_ids"][:16] for _, turns in first_turn]
    assert systems[0] == systems[2] != systems[1]  # two system prompts, shared
    orders = [[r["conversation"] for r in trace if r["turn"] == t] for t in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # users come back in their own order


def test_reusable_tokens_count_whole_blocks_shared_with_earlier_requests_never_the_last_token():
    trace = [
        {"hash_ids": [1, 2, 3], "input_length": 70},
        {"hash_ids": [1, 2, 4], "input_length": 80},  # shares 2 blocks
        {"hash_ids": [1, 2, 4, 5], "input_length": 97},  # shares 3 blocks
        {"hash_ids": [1, 2], "input_length": 64},  # all of it was seen: the last token is computed, so 1 block
        {"hash_ids": [9], "input_length": 10},
    ]
    assert reusable_tokens(trace) == [0, 64, 96, 32, 0]


def test_each_policy_gets_other_tokens_of_the_same_shape():
    request = make_trace(conversations=1, turns=1, system_prompts=1, system_blocks=2)[0]
    one, two = (token_ids(request, offset=k * 1_000_003, vocab=32000) for k in (1, 2))
    assert len(one) == len(two) == request["input_length"] and one != two
    assert token_ids(request, offset=1_000_003, vocab=32000) == one


def test_a_machine_without_vllm_still_names_every_figure():
    nulls = routing.null_result("no vLLM", "quick")
    assert all(nulls[name] is None for name in routing.FIGURES) and len(routing.FIGURES) == 4
