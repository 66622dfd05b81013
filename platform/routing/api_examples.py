"""Request and response examples for the engine-routing operations of the published reference (a vLLM engine
serving Llama-3-8B with 16-token blocks, publishing KV events over ZMQ)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

INSTANCE_ID = "e1f2a3b4-c5d6-4e7f-8a9b-0c1d2e3f4a5b"
CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"

REGISTRATION = {
    "name": "vllm-a",
    "model": MODEL,
    "block_size": 16,
    "api_base": "http://10.0.3.21:8000",
    "events_endpoint": "tcp://10.0.3.21:5557",
    "replay_endpoint": "tcp://10.0.3.21:5558",
}
INSTANCE = {
    "id": INSTANCE_ID,
    **REGISTRATION,
    "state": "live",
    "next_seq": 1842,
    "events_applied": 1842,
    "gaps": 0,
    "last_event_at": "2026-03-02T10:14:58Z",
    "last_healthy_at": "2026-03-02T10:14:55Z",
    "requests_waiting": 0,
    "requests_running": 3,
    "created_at": "2026-03-02T09:30:00Z",
}

REGISTER = OpenApiExample("A vLLM engine", value=REGISTRATION, request_only=True)
REGISTERED = OpenApiExample(
    "Registered",
    value={
        **INSTANCE,
        "next_seq": 0,
        "events_applied": 0,
        "last_event_at": None,
        "last_healthy_at": None,
        "requests_waiting": None,
        "requests_running": None,
    },
    response_only=True,
    status_codes=["201"],
)
INSTANCE_LIVE = OpenApiExample("A live engine", value=INSTANCE, response_only=True, status_codes=["200"])
INSTANCE_LIST = OpenApiExample("The tenant's engines", value=INSTANCE, response_only=True, status_codes=["200"])
LOOKUP = OpenApiExample(
    "A 40-token prompt",
    value={"model": MODEL, "token_ids": [128000, 9906, 11, 1268, 527] + [13] * 35},
    request_only=True,
)
LOOKUP_HITS = OpenApiExample(
    "Two blocks on the engine's GPU, all on the cache",
    value={
        "model": MODEL,
        "num_tokens": 40,
        "instances": [
            {
                "id": INSTANCE_ID,
                "name": "vllm-a",
                "api_base": "http://10.0.3.21:8000",
                "block_size": 16,
                "prefix_tokens": {"GPU": 32},
                "used_blocks": 5120,
                "requests_waiting": 0,
                "requests_running": 3,
            }
        ],
        "caches": [
            {
                "id": CACHE_ID,
                "name": "llama3-8b-chat",
                "block_size": 16,
                "prefix_tokens": {"GPU": 32, "CPU": 32, "STORAGE": 32, "NETWORK": 32},
                "used_blocks": 2048,
            }
        ],
    },
    response_only=True,
    status_codes=["200"],
)
