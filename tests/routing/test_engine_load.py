"""An engine's queue from its Prometheus text (routing.engine_load): vLLM's two gauges summed over their label
sets; an engine that does not report them, or a scrape that fails, is unknown, never 0."""

from routing.engine_load import EngineQueue, parse_queue, read_queue
from tests.faults import free_port

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
"""


def test_the_gauges_are_summed_over_engines_and_a_missing_one_is_unknown():
    assert parse_queue(VLLM_METRICS) == EngineQueue(waiting=5, running=3)
    assert parse_queue("process_cpu_seconds_total 1.0\n") == EngineQueue(None, None)
    assert parse_queue("vllm:num_requests_waiting NaN\n") == EngineQueue(None, None)


def test_an_engine_that_does_not_answer_has_an_unknown_queue():
    assert read_queue(f"http://127.0.0.1:{free_port()}", 1.0) == EngineQueue(None, None)
