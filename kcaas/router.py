"""A KV-aware router: an OpenAI-compatible proxy in front of a tenant's engine instances that sends each request to
the instance already holding most of its prompt's KV, weighed against load (docs/routing.md).

    KCAAS_API_KEY=kc_live_... python -m kcaas.router --kcaas-url http://127.0.0.1:8000 --model MODEL [--port 8100]
        [--policy kv|least_loaded|round_robin]

The instances are the tenant's live engine instances serving MODEL (GET /api/v1/engines, refreshed every
`refresh_s`). Per request (policy kv): the prompt's token ids (a completion's `prompt` as ids; else the first
instance's /tokenize), one POST /api/v1/engines/lookup, then for each instance

    cost = blocks to prefill + load_weight * blocks of the requests this router has in flight there

where the blocks to prefill credit what the instance holds in device memory fully and what it holds in its CPU tier
at `cpu_credit` (a lower tier still costs a transfer), and the cheapest instance wins (ties: fewer requests in
flight, then round-robin order). If the lookup fails or times out the request goes to the least loaded instance
(counted as a fallback): the router never waits on KCaaS longer than `lookup_timeout_s`. With the KCaaS connector
on every instance, a request sent where its prefix is not still loads it from the cache.

An instance that refuses the connection (it died before the indexer noticed) is skipped for two refresh periods and
the request goes to the next choice, once (counted as a failover). Answers carry `x-kcaas-instance` (where it went)
and `x-kcaas-expected-hit-tokens`; GET /metrics counts requests, decisions, expected hit tokens, fallbacks and
failovers (Prometheus text). Needs aiohttp (`pip install kcaas[router]`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientConnectorError, ClientError, ClientSession, ClientTimeout, ServerDisconnectedError, web

logger = logging.getLogger("kcaas.router")
POLICIES = ("kv", "least_loaded", "round_robin")
PROXIED = ("/v1/completions", "/v1/chat/completions")


class _NotTaken(Exception):
    """An instance closed the connection before its answer started (it was going down): like a refusal."""


@dataclass
class Instance:
    name: str
    api_base: str
    block_size: int
    in_flight: int = 0
    in_flight_blocks: int = 0
    down_until: float = 0.0  # refused a connection: skipped until then (monotonic seconds)


@dataclass
class Decision:
    instance: Instance
    expected_hit_tokens: int
    reason: str  # "kv", "least_loaded", "round_robin", or "fallback: <why>"


@dataclass
class RouterConfig:
    kcaas_url: str
    api_key: str
    model: str
    policy: str = "kv"
    cpu_credit: float = 0.5
    load_weight: float = 1.0
    lookup_timeout_s: float = 0.5
    refresh_s: float = 2.0
    request_timeout_s: float = 600.0


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # (instance, reason kind) -> requests
    expected_hit_tokens: int = 0
    prompt_tokens: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    lookup_seconds: float = 0.0
    lookups: int = 0
    failovers: int = 0  # an instance refused the connection: the request went to another

    def text(self) -> str:
        lines = ["# TYPE kcaas_router_requests_total counter"]
        for (instance, reason), n in sorted(self.requests.items()):
            lines.append(f'kcaas_router_requests_total{{instance="{instance}",decision="{reason}"}} {n}')
        lines += [
            "# TYPE kcaas_router_expected_hit_tokens_total counter",
            f"kcaas_router_expected_hit_tokens_total {self.expected_hit_tokens}",
            "# TYPE kcaas_router_prompt_tokens_total counter",
            f"kcaas_router_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE kcaas_router_fallbacks_total counter",
        ]
        lines += [f'kcaas_router_fallbacks_total{{reason="{why}"}} {n}' for why, n in sorted(self.fallbacks.items())]
        lines += [
            "# TYPE kcaas_router_failovers_total counter",
            f"kcaas_router_failovers_total {self.failovers}",
            "# TYPE kcaas_router_lookup_seconds summary",
            f"kcaas_router_lookup_seconds_sum {self.lookup_seconds:.6f}",
            f"kcaas_router_lookup_seconds_count {self.lookups}",
        ]
        return "\n".join(lines) + "\n"


def choose(
    instances: list[Instance], prompt_tokens: int, hits: dict[str, dict[str, int]], config: RouterConfig
) -> tuple[Instance, int]:
    """The instance of least cost for a prompt of `prompt_tokens` (hits: instance name -> medium -> prefix tokens),
    and the tokens it is expected to hit. Ties: fewer requests in flight, then the order given."""

    def expected(instance: Instance) -> float:
        held = hits.get(instance.name, {})
        device = held.get("GPU", 0)
        return device + config.cpu_credit * max(held.get("CPU", 0) - device, 0)

    def cost(instance: Instance) -> tuple[float, int]:
        to_prefill = math.ceil(max(prompt_tokens - expected(instance), 0) / instance.block_size)
        return to_prefill + config.load_weight * instance.in_flight_blocks, instance.in_flight

    best = min(instances, key=cost)  # min keeps the first of equals: the caller rotates the order
    return best, int(hits.get(best.name, {}).get("GPU", 0))


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.instances: dict[str, Instance] = {}
        self.metrics = Metrics()
        self._turn = itertools.count()
        self._session: ClientSession | None = None

    # ---- instances --------------------------------------------------------------------------------------------------
    def _kcaas_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"}

    async def refresh(self) -> None:
        """The tenant's live instances of the model (kept: each one's in-flight counts)."""
        async with self.session.get(
            f"{self.config.kcaas_url}/api/v1/engines", headers=self._kcaas_headers(), timeout=ClientTimeout(total=5)
        ) as answer:
            answer.raise_for_status()
            listed = await answer.json()
        live = {e["name"]: e for e in listed if e["model"] == self.config.model and e["state"] == "live"}
        for name in set(self.instances) - set(live):
            del self.instances[name]
        for name, e in live.items():
            if name not in self.instances:
                self.instances[name] = Instance(name, e["api_base"], e["block_size"])

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except (TimeoutError, ClientError, ValueError) as exc:
                logger.warning("router: cannot list the engine instances (%s); keeping %d", exc, len(self.instances))
            await asyncio.sleep(self.config.refresh_s)

    @property
    def session(self) -> ClientSession:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=self.config.request_timeout_s))
        return self._session

    # ---- decisions --------------------------------------------------------------------------------------------------
    def _rotated(self) -> list[Instance]:
        """The instances to choose from, in this request's rotation: those not refusing connections (all of them
        if every one is)."""
        now = time.monotonic()
        ordered = sorted(self.instances.values(), key=lambda i: i.name)
        ordered = [i for i in ordered if i.down_until <= now] or ordered
        start = next(self._turn) % len(ordered)
        return ordered[start:] + ordered[:start]

    async def decide(self, token_ids: list[int] | None) -> Decision:
        rotated = self._rotated()
        if self.config.policy == "round_robin":
            return Decision(rotated[0], 0, "round_robin")
        least = min(rotated, key=lambda i: i.in_flight)
        if self.config.policy == "least_loaded":
            return Decision(least, 0, "least_loaded")
        if token_ids is None:
            return self._fallback(least, "no token ids")
        try:
            hits = await self._lookup(token_ids)
        except (TimeoutError, ClientError, ValueError, KeyError) as exc:
            return self._fallback(least, type(exc).__name__)
        best, expected = choose(rotated, len(token_ids), hits, self.config)
        return Decision(best, expected, "kv")

    def _fallback(self, instance: Instance, why: str) -> Decision:
        self.metrics.fallbacks[why] += 1
        return Decision(instance, 0, f"fallback: {why}")

    async def _lookup(self, token_ids: list[int]) -> dict[str, dict[str, int]]:
        started = time.perf_counter()
        try:
            async with self.session.post(
                f"{self.config.kcaas_url}/api/v1/engines/lookup",
                json={"model": self.config.model, "token_ids": token_ids},
                headers=self._kcaas_headers(),
                timeout=ClientTimeout(total=self.config.lookup_timeout_s),
            ) as answer:
                answer.raise_for_status()
                body = await answer.json()
        finally:
            self.metrics.lookup_seconds += time.perf_counter() - started
            self.metrics.lookups += 1
        return {hit["name"]: hit["prefix_tokens"] for hit in body["instances"]}

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: a completion's prompt given as ids, else the engine's own /tokenize (None if
        that fails: the request is routed by load)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if not self.instances:
            return None
        first = next(iter(self.instances.values()))
        query: dict[str, Any] = {"model": self.config.model}
        query.update({"prompt": prompt} if path == "/v1/completions" else {"messages": body.get("messages")})
        try:
            async with self.session.post(
                f"{first.api_base}/tokenize", json=query, timeout=ClientTimeout(total=self.config.lookup_timeout_s)
            ) as answer:
                answer.raise_for_status()
                return list((await answer.json())["tokens"])
        except (TimeoutError, ClientError, ValueError, KeyError):
            return None

    # ---- HTTP -------------------------------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "the body must be JSON", "code": "bad_request"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the body must be an object", "code": "bad_request"}}, status=400
            )
        if not self.instances:
            return web.json_response(
                {"error": {"message": f"no live instance serves {self.config.model}", "code": "no_instance"}},
                status=503,
                headers={"Retry-After": str(math.ceil(self.config.refresh_s))},
            )
        tokens = await self.token_ids(request.path, body)
        decision = await self.decide(tokens)
        try:
            return await self._forward(request, body, decision, len(tokens or ()))
        except (ClientConnectorError, _NotTaken):  # refused, or dropped before answering: one other instance may
            decision.instance.down_until = time.monotonic() + 2 * self.config.refresh_s
            self.metrics.failovers += 1
            retry = await self.decide(tokens)
            if retry.instance is decision.instance:
                return self._upstream_failed(retry.instance, "refused the connection")
            try:
                return await self._forward(request, body, retry, len(tokens or ()))
            except (ClientConnectorError, _NotTaken):
                retry.instance.down_until = time.monotonic() + 2 * self.config.refresh_s
                return self._upstream_failed(retry.instance, "refused the connection")

    async def _forward(self, request: web.Request, body: dict, decision: Decision, prompt_tokens: int):
        instance = decision.instance
        blocks = math.ceil(prompt_tokens / instance.block_size)
        instance.in_flight += 1
        instance.in_flight_blocks += blocks
        self.metrics.requests[(instance.name, decision.reason.split(":")[0])] += 1
        self.metrics.expected_hit_tokens += decision.expected_hit_tokens
        self.metrics.prompt_tokens += prompt_tokens
        headers = {"x-kcaas-instance": instance.name, "x-kcaas-expected-hit-tokens": str(decision.expected_hit_tokens)}
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(f"{instance.api_base}{request.path}", json=body) as upstream:
                response = web.StreamResponse(status=upstream.status, headers=headers)
                response.content_type = upstream.content_type
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except ClientConnectorError:
            raise
        except ServerDisconnectedError as exc:  # an instance going down closed the connection
            if response is None:  # before its answer started: another instance may take it, as for a refusal
                raise _NotTaken(str(exc)) from exc
            return response
        except (ClientError, TimeoutError) as exc:
            if response is not None and response.prepared:
                return response  # the client saw the answer start: it ends short, as the instance's did
            return self._upstream_failed(instance, str(exc))
        finally:
            instance.in_flight -= 1
            instance.in_flight_blocks -= blocks

    @staticmethod
    def _upstream_failed(instance: Instance, why: str) -> web.Response:
        return web.json_response(
            {"error": {"message": f"instance {instance.name} failed: {why}", "code": "upstream_failed"}},
            status=502,
            headers={"x-kcaas-instance": instance.name},
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.instances else 503)

    async def metrics_view(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.text(), content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in PROXIED:
            app.router.add_post(path, self.proxy)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_view)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        try:
            await self.refresh()
        except (TimeoutError, ClientError, ValueError) as exc:
            logger.warning("router: cannot list the engine instances yet (%s)", exc)
        app["refresher"] = asyncio.create_task(self._refresh_forever())

    async def _stop(self, app: web.Application) -> None:
        app["refresher"].cancel()
        if self._session is not None:
            await self._session.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kcaas.router", description=__doc__.splitlines()[0])
    parser.add_argument("--kcaas-url", default=os.environ.get("KCAAS_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--model", required=True, help="the model the instances serve (their OpenAI `model`)")
    parser.add_argument("--policy", choices=POLICIES, default="kv")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--cpu-credit", type=float, default=0.5, help="weight of a CPU-tier hit against a device one")
    parser.add_argument(
        "--load-weight", type=float, default=1.0, help="cost of a block in flight against one to prefill"
    )
    parser.add_argument("--lookup-timeout", type=float, default=0.5, help="seconds before routing by load instead")
    args = parser.parse_args(argv)
    api_key = os.environ.get("KCAAS_API_KEY")
    if not api_key:
        parser.error("set KCAAS_API_KEY to a key of the tenant whose engines this routes to (caches:read)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig(
        kcaas_url=args.kcaas_url.rstrip("/"),
        api_key=api_key,
        model=args.model,
        policy=args.policy,
        cpu_credit=args.cpu_credit,
        load_weight=args.load_weight,
        lookup_timeout_s=args.lookup_timeout,
    )
    web.run_app(Router(config).app(), host=args.host, port=args.port, print=lambda *a: print(*a, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
