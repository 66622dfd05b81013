"""bench.hit_cost runs end to end (quick: a node process, TLS 1.3, the vLLM bench's 45 MiB load) and reports every
figure it promises; its stage clock times what it wraps and puts everything back."""

import json
import subprocess
import sys

from bench._hit_cost_probe import Probe, client_stages, node_stages
from bench.hit_cost import hit_fields, load_tokens

NODE_STAGES = {"check", "lookup", "block_reads", "framing", "handle_other", "tls_send", "tls_send_cpu", "after_send"}
CLIENT_STAGES = {
    "request",
    "wait_first_bytes",
    "answer_head",
    "recv_decrypt_into_out",
    "recv_decrypt_cpu",
    "parse",
    "result_views",
    "python_other",
}


class Adder:
    def add(self, a: int, b: int) -> int:
        return a + b


def test_the_probe_times_wrapped_calls_and_restores_them():
    probe, original = Probe(), Adder.__dict__["add"]
    probe.wrap(Adder, "add", "adding")
    assert Adder().add(2, 3) == 5 and Adder().add(1, 1) == 2
    calls = probe.take()
    assert [stage for stage, *_ in calls] == ["adding", "adding"]
    assert all(t1 >= t0 and cpu >= 0 for _, t0, t1, cpu in calls)
    assert probe.take() == []
    probe.restore()
    assert Adder.__dict__["add"] is original


def test_stages_from_calls():
    ms = 1_000_000
    node = node_stages(
        [("handle", 0, 10 * ms, 9 * ms), ("lookup", 1 * ms, 3 * ms, 2 * ms), ("send", 10 * ms, 50 * ms, 20 * ms)]
    )
    assert node["lookup"] == 2.0 and node["handle_other"] == 8.0 and node["tls_send"] == 40.0
    assert node["tls_send_cpu"] == 20.0 and set(node) == NODE_STAGES
    calls = [
        ("request_encode", 0, 1 * ms, 0),
        ("request_send", 1 * ms, 2 * ms, 0),
        ("read_frame", 2 * ms, 60 * ms, 30 * ms),
        ("answer_head", 5 * ms, 6 * ms, 0),
        ("parse", 60 * ms, 61 * ms, 0),
    ]
    client = client_stages(calls, 0, 62 * ms)
    assert client["request"] == 2.0 and client["wait_first_bytes"] == 3.0 and client["recv_decrypt_into_out"] == 54.0
    assert client["python_other"] == 1.0 and set(client) == CLIENT_STAGES


def test_the_load_is_the_vllm_benchs():
    fields = hit_fields()
    assert (fields["num_layers"], fields["num_kv_heads"], fields["head_dim"], fields["block_size"]) == (12, 4, 64, 128)
    assert load_tokens() == 1920  # the whole 128-token blocks of the 2,000-token prompt


def test_the_cli_prints_every_figure_in_its_last_line():
    done = subprocess.run(
        [sys.executable, "-m", "bench.hit_cost", "--quick"], capture_output=True, text=True, timeout=600, check=True
    )
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["bytes"] == 1920 * 12 * 2 * 4 * 64 * 4 and r["tokens"] == 1920
    for key in ("hit_ms", "raw_tls_ms", "memcpy_ms", "hit_busy_ms", "gbps", "raw_tls_gbps", "hit_vs_raw_tls"):
        assert r[key] > 0, key
    assert r["hit_client_cpu_ms"] > 0 and r["instrumented_hit_ms"] > 0
    assert set(r["stages_ms"]["node"]) == NODE_STAGES and set(r["stages_ms"]["client"]) == CLIENT_STAGES
    assert all(v >= 0 for side in r["stages_ms"].values() for v in side.values())
    assert r["stages_ms"]["node"]["tls_send"] > 0 and r["stages_ms"]["client"]["recv_decrypt_into_out"] > 0
