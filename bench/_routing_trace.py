"""The multi-turn trace of bench.routing, in the public Mooncake trace's format (one JSON object per request:
`timestamp` ms, `input_length`, `output_length`, `hash_ids`: one id per `BLOCK_TOKENS` tokens of the prompt, equal ids
= equal content), generated locally, and the token ids it stands for. Not a benchmark of its own (`make bench` skips
bench/_*.py).

Shape: conversations over a few shared system prompts; each turn's prompt is the whole conversation so far (system
prompt, earlier user turns and answers) plus a new user turn, as a chat engine sends it. Each policy gets its own copy
of the trace with its own ids (`offset`): same shapes, no content shared between policies.
"""

from __future__ import annotations

import random

BLOCK_TOKENS = 32  # tokens per hash id (the engines' KV block size here; Mooncake's public trace uses 512)


def make_trace(*, conversations: int, turns: int, system_prompts: int, system_blocks: int, seed: int = 7) -> list[dict]:
    """The requests in send order: turn 1 of every conversation, then turn 2 of every one (in another order), ..."""
    rng = random.Random(seed)
    next_id = system_prompts * system_blocks
    histories = []
    for c in range(conversations):
        s = c % system_prompts
        histories.append(list(range(s * system_blocks, (s + 1) * system_blocks)))
    trace = []
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)  # users come back in their own time: no turn-by-turn period a rotation could follow
        for c in order:
            history = histories[c]
            new_blocks = rng.randint(3, 6)  # the previous answer and the new user turn
            history.extend(range(next_id, next_id + new_blocks))
            next_id += new_blocks
            tail = rng.randint(1, BLOCK_TOKENS - 1)  # the prompt ends inside its last block
            trace.append(
                {
                    "timestamp": len(trace) * 1000,
                    "input_length": (len(history) - 1) * BLOCK_TOKENS + tail,
                    "output_length": 1,
                    "hash_ids": list(history),
                    "conversation": c,
                    "turn": turn,
                }
            )
    return trace


def token_ids(request: dict, *, offset: int, vocab: int) -> list[int]:
    """The prompt a trace request stands for: each hash id's tokens drawn from a generator seeded by the id (plus
    the policy's offset), cut to input_length."""
    tokens: list[int] = []
    for hash_id in request["hash_ids"]:
        rng = random.Random(hash_id + offset)
        tokens.extend(rng.randrange(vocab) for _ in range(BLOCK_TOKENS))
    return tokens[: request["input_length"]]


def reusable_tokens(trace: list[dict]) -> list[int]:
    """For each request, the most of its prompt any engine could have cached before it: the longest run of leading
    hash ids some earlier request shared, in whole blocks, never the prompt's last token (an engine computes it)."""
    seen: set[tuple[int, ...]] = set()
    reusable = []
    for request in trace:
        ids = request["hash_ids"]
        run = 0
        while run < len(ids) and tuple(ids[: run + 1]) in seen:
            run += 1
        limit = (request["input_length"] - 1) // BLOCK_TOKENS
        reusable.append(min(run, limit) * BLOCK_TOKENS)
        seen.update(tuple(ids[: i + 1]) for i in range(len(ids)))
    return reusable
