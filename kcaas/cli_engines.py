"""`kcaas engines ...`: the tenant's engine instances for KV-aware routing (docs/routing.md), over kcaas.Client.

    kcaas engines register gpu-0 --model my-llama --block-size 32 --api-base http://10.0.0.5:8000 \\
        --events tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5558
    kcaas engines ls
    kcaas engines lookup --model my-llama --tokens 1,2,3,...      # or --tokens-file ids.json
    kcaas engines deregister gpu-0
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from kcaas.cli_errors import UsageError
from kcaas.cli_output import Out, table
from kcaas.kv_events import MEDIA  # GPU, CPU, STORAGE, NETWORK: the columns, fastest first


def _instance_id(client, wanted: str) -> str:
    """An instance's id from its id, id prefix or name. Raises UsageError when none or several match."""
    found = [e for e in client.engines() if wanted in (e.id, e.name) or e.id.startswith(wanted)]
    if len(found) != 1:
        raise UsageError(f"{'no' if not found else 'more than one'} engine instance matches {wanted!r}")
    return found[0].id


def cmd_engines_register(client, args, out: Out) -> None:
    engine = client.register_engine(
        args.name,
        model=args.model,
        block_size=args.block_size,
        api_base=args.api_base,
        events_endpoint=args.events,
        replay_endpoint=args.replay or "",
    )
    out.result(engine, lambda: f"{engine.id} {engine.name}: {engine.state}, indexing {engine.events_endpoint}")


def cmd_engines_ls(client, args, out: Out) -> None:
    engines = client.engines()
    rows = [
        [e.name, e.model, e.state, e.block_size, e.api_base, e.events_applied, e.gaps, _known(e.requests_waiting)]
        for e in engines
    ]
    headers = ("NAME", "MODEL", "STATE", "BLOCK", "API BASE", "EVENTS", "GAPS", "WAITING")
    out.result(engines, lambda: table(headers, rows, elidable=("MODEL", "API BASE")))


def _known(value: int | None) -> str:
    return "-" if value is None else str(value)


def cmd_engines_deregister(client, args, out: Out) -> None:
    instance_id = _instance_id(client, args.engine)
    client.deregister_engine(instance_id)
    out.result({"id": instance_id, "deregistered": True}, lambda: f"{instance_id}: deregistered")


def _tokens(args) -> list[int]:
    try:
        if args.tokens_file:
            with open(args.tokens_file) as f:
                values = json.load(f)
        else:
            values = [int(t) for t in args.tokens.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the token ids: {exc}") from None
    if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise UsageError("the token ids must be a JSON list of integers")
    return values


def cmd_engines_lookup(client, args, out: Out) -> None:
    tokens = _tokens(args)
    answer = client.prefix_lookup(args.model, tokens, lora_name=args.lora)
    rows = [["instance", h.name, *(h.prefix_tokens.get(m, 0) for m in MEDIA), h.used_blocks] for h in answer.instances]
    rows += [["cache", h.name, *(h.prefix_tokens.get(m, 0) for m in MEDIA), h.used_blocks] for h in answer.caches]
    headers = ("KIND", "NAME", *(f"{m} TOKENS" for m in MEDIA), "USED BLOCKS")
    out.result(answer, lambda: f"{len(tokens)} tokens\n" + table(headers, rows))


def add_engine_commands(commands, command: Callable[..., argparse.ArgumentParser], parser_class) -> None:
    """`kcaas engines register|ls|deregister|lookup` under `commands` (command: kcaas.cli's subcommand maker)."""
    engines = commands.add_parser(
        "engines",
        help="engine instances (KV-aware routing)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = engines.add_subparsers(dest="engines_command", required=True, metavar="COMMAND", parser_class=parser_class)
    register = command(sub, "register", cmd_engines_register, "register a vLLM instance publishing KV events")
    register.add_argument("name")
    register.add_argument("--model", required=True, help="the model as the instance serves it")
    register.add_argument("--block-size", type=int, required=True, help="the instance's KV block size")
    register.add_argument("--api-base", required=True, metavar="URL", help="its OpenAI server, http://IP:port")
    register.add_argument("--events", required=True, metavar="tcp://IP:PORT", help="its KV event publisher")
    register.add_argument("--replay", metavar="tcp://IP:PORT", help="its replay socket (recommended)")
    command(sub, "ls", cmd_engines_ls, "list the tenant's engine instances and their index state")
    command(sub, "deregister", cmd_engines_deregister, "forget an instance").add_argument(
        "engine", help="its id, id prefix or name"
    )
    lookup = command(sub, "lookup", cmd_engines_lookup, "which instance holds the longest prefix of these tokens")
    lookup.add_argument("--model", required=True)
    given = lookup.add_mutually_exclusive_group(required=True)
    given.add_argument("--tokens", help="comma-separated token ids")
    given.add_argument("--tokens-file", metavar="FILE.json", help="a JSON list of token ids")
    lookup.add_argument("--lora", help="the LoRA adapter's name, if the request uses one")
