"""kcaas.router's decisions: the cost of prefilling what an instance lacks against the load it carries; a lower tier
credited less; ties spread; and a lookup that fails never holds a request (least loaded, counted)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kcaas.router import Instance, Router, RouterConfig, choose
from tests.faults import free_port

CONFIG = RouterConfig(kcaas_url="http://127.0.0.1:1", api_key="k", model="m", cpu_credit=0.5, load_weight=1.0)


def instances(**in_flight_blocks: int) -> list[Instance]:
    return [
        Instance(name, f"http://{name}", 16, in_flight=1 if blocks else 0, in_flight_blocks=blocks)
        for name, blocks in in_flight_blocks.items()
    ]


def test_the_instance_holding_the_prefix_wins_until_its_load_outweighs_it():
    hits = {"a": {"GPU": 320}, "b": {}}
    assert choose(instances(a=0, b=0), 400, hits, CONFIG)[0].name == "a"  # 5 blocks to prefill against 25
    assert choose(instances(a=19, b=0), 400, hits, CONFIG)[0].name == "a"  # 5 + 19 < 25
    assert choose(instances(a=21, b=0), 400, hits, CONFIG)[0].name == "b"  # 5 + 21 > 25: too busy
    best, expected = choose(instances(a=0, b=0), 400, hits, CONFIG)
    assert expected == 320


def test_a_cpu_tier_hit_counts_less_than_one_in_device_memory():
    hits = {"a": {"CPU": 320}, "b": {"GPU": 200}}
    assert choose(instances(a=0, b=0), 400, hits, CONFIG)[0].name == "b"  # a: 400 - 160 left, b: 200 left
    hits = {"a": {"CPU": 320, "GPU": 160}, "b": {"GPU": 200}}
    assert choose(instances(a=0, b=0), 400, hits, CONFIG)[0].name == "a"  # a: 160 + 80 credited


def test_ties_go_to_the_first_of_the_rotation_and_then_to_fewer_requests_in_flight():
    assert choose(instances(a=0, b=0), 64, {}, CONFIG)[0].name == "a"
    assert choose(instances(b=0, a=0), 64, {}, CONFIG)[0].name == "b"


def test_a_failed_lookup_routes_by_load_and_is_counted():
    router = Router(RouterConfig(kcaas_url=f"http://127.0.0.1:{free_port()}", api_key="k", model="m"))
    router.instances = {i.name: i for i in instances(a=8, b=0)}

    async def decide():
        try:
            return await router.decide(list(range(64)))
        finally:
            await router.session.close()

    with ThreadPoolExecutor(1) as thread:  # its own event loop, whatever loop this thread may have running
        decision = thread.submit(asyncio.run, decide()).result(timeout=30)
    assert decision.instance.name == "b" and decision.reason.startswith("fallback")
    assert sum(router.metrics.fallbacks.values()) == 1 and router.metrics.lookups == 1
