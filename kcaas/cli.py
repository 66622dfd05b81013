"""The `kcaas` command line: caches, data tokens, API keys and usage over kcaas.Client.

    kcaas attach chat --model-fingerprint llama-3-8b@main --num-layers 32 --num-kv-heads 8 --head-dim 128 \\
        --device-bytes 2GiB
    kcaas ls
    kcaas show chat
    kcaas usage --json
    kcaas admin tenants create acme --device-bytes 8GiB      # platform administrators: kcaas/cli_admin.py

Configuration: `--url` / KCAAS_URL (default http://127.0.0.1:8000, what `make up` serves) and `--api-key` /
KCAAS_API_KEY; `kcaas admin ...` takes KCAAS_ADMIN_USER (default admin) and KCAAS_ADMIN_PASSWORD instead (HTTP
basic). The key (or password) is never printed: every line written to stderr is scrubbed of it (and of anything
shaped like a KCaaS key), and the SDK keeps it out of its errors.

Naming: wherever a cache or key id is taken, so is its name or an id prefix (kcaas/cli_resolve.py).

Output (kcaas/cli_output.py): tables and `name: value` lines on stdout, progress, notes and errors on stderr; tables
fit 100 columns (short ids, long cells cut with `...`), `--wide` prints them whole. `ls` leaves detached caches
out (`--all` lists them). `--json` (anywhere on the line) prints one JSON document on stdout instead, and an error
as `{"error": {...}}` on stderr. A value the server changed (a token's TTL clamped to its range) is reported on
stderr as `kcaas: note: ...`.

Exit codes: 0 done; 1 the API refused or a cache failed (`error: <code>: <message>`, the details one per line, and
a `hint:`; kcaas/cli_errors.py); 2 a usage error (argparse, an unreadable spec file, no API key); 3 no usable
answer from the control plane (no connection, or a server that does not answer as the KCaaS API); 130 interrupted;
141 stdout was closed early (`kcaas ls | head -1`: the rest is dropped quietly, as a Unix tool does).
No failure prints a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kcaas.cli_admin import add_admin_commands, admin_client, with_admin_hint
from kcaas.cli_engines import add_engine_commands
from kcaas.cli_errors import EXIT_API, EXIT_CONNECTION, UsageError, report, unreadable_answer  # noqa: F401
from kcaas.cli_output import KEY_SHAPE, TABLE_WIDTH, Out, human_bytes, parse_bytes, short_ids, table, when
from kcaas.cli_resolve import cache_id, key_id
from kcaas.client import Client
from kcaas.errors import KcaasError
from kcaas.spec import KVCacheSpec, SpecError, latent_head_shape
from kcaas.usage import QUOTA_PAIRS

__all__ = ["main", "human_bytes", "parse_bytes"]

DEFAULT_URL = "http://127.0.0.1:8000"
# A person waits at the prompt: the CLI rides out a blip of a few seconds, not the SDK's 30 s outage budget.
INTERACTIVE_RETRY_BUDGET_SECONDS = 5.0
EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a Unix tool killed by a closed pipe reports
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(KVCacheSpec))
# storage_dtype defaults to kv_dtype; an 'mla' spec's num_kv_heads and head_dim to what its latent width implies
SPEC_DEFAULTS = {"block_size": 16, "kv_dtype": "float16", "attention": "mha", "kv_lora_rank": 0, "qk_rope_head_dim": 0}
HIDDEN_STATES = ("detached",)  # left out of `ls` unless --all (failed caches stay: they hold quota until detached)
# The server's answers a broken or foreign server turns into these when the SDK reads them.
_UNREADABLE = (AttributeError, KeyError, TypeError, ValueError)
EPILOG = f"""\
environment:
  KCAAS_URL      the control plane's URL, as --url (default {DEFAULT_URL}, `make up`'s)
  KCAAS_API_KEY  the tenant API key, as --api-key (never printed)
  KCAAS_ADMIN_USER, KCAAS_ADMIN_PASSWORD  `kcaas admin ...`: a platform administrator

names: caches and keys are taken by id, by name, or by an id prefix as `kcaas ls` prints it.
ls: detached caches are left out unless --all; failed ones are listed (they hold quota
  until detached).
clamps: the server clamps `token --ttl` to its range (60 s up to its configured maximum); the
  CLI then says so on stderr (`kcaas: note: ...`) and prints the token it got.
exit codes: 0 done, 1 refused by the API, 2 usage error, 3 no usable answer from --url,
  130 interrupted."""


# ---- commands --------------------------------------------------------------------------------------------------------


def _spec_from_args(args: argparse.Namespace) -> KVCacheSpec:
    fields: dict[str, Any] = {}
    if args.spec:
        try:
            with open(args.spec, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read the spec file {args.spec}: {exc}") from None
        if isinstance(loaded, dict) and isinstance(loaded.get("spec"), dict):
            loaded = loaded["spec"]  # an attach body, as the API takes it
        if not isinstance(loaded, dict):
            raise UsageError(f"the spec file {args.spec} must hold a JSON object of {', '.join(SPEC_FIELDS)}")
        fields.update({k: v for k, v in loaded.items() if k in SPEC_FIELDS})
    fields.update({name: getattr(args, name) for name in SPEC_FIELDS if getattr(args, name) is not None})
    for name, default in SPEC_DEFAULTS.items():
        fields.setdefault(name, default)
    fields.setdefault("storage_dtype", fields["kv_dtype"])
    if fields["attention"] == "mla":
        heads, head_dim = latent_head_shape(fields["kv_lora_rank"], fields["qk_rope_head_dim"])
        fields.setdefault("num_kv_heads", heads)
        fields.setdefault("head_dim", head_dim)
    missing = [name for name in SPEC_FIELDS if name not in fields]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise UsageError(f"the KV cache spec lacks {flags} (or give --spec FILE.json)")
    try:
        return KVCacheSpec(**fields)
    except (SpecError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _contents(cache) -> str:
    """What the API's `contents` means (docs/controlplane.md, "Emptied caches"), in words: only a ready cache has
    any; cold says why when the API says so (emptied_at after its node came back without it)."""
    if cache.contents == "warm":
        return "warm: its node reports blocks of it"
    if cache.contents == "cold" and cache.emptied_at is not None:
        return f"cold: its node came back without it at {when(cache.emptied_at)}; prefixes are recomputed until re-put"
    if cache.contents == "cold":
        return "cold: its node reports no block of it (nothing stored yet, or all deleted)"
    return "-"


def _show_cache(cache) -> str:
    spec = cache.spec
    layout = "-"
    if spec:
        layout = (
            f"{spec.num_layers} layers, {spec.num_kv_heads} kv heads x {spec.head_dim}, block {spec.block_size}, "
            f"{spec.kv_dtype} (stored {spec.storage_dtype})"
        )
    lines = [
        ("id", cache.id),
        ("name", cache.name),
        ("state", cache.state + (f" ({cache.failure_reason})" if cache.failure_reason else "")),
        ("node", cache.node_id or "-"),
        ("endpoint", cache.endpoint or "-"),
        ("epoch", cache.epoch),
        ("contents", _contents(cache)),
        ("capacity", ", ".join(f"{tier} {human_bytes(b)}" for tier, b in cache.capacity.items() if b) or "-"),
        ("write-through", "network" if cache.network_write_through else "-"),
        ("block bytes", cache.block_bytes),
        ("model", spec.model_fingerprint if spec else "-"),
        ("layout", layout),
        ("created", when(cache.created_at)),
        ("updated", when(cache.updated_at)),
    ]
    return "\n".join(f"{name + ':':<13}{value}" for name, value in lines)


def _progress(out: Out, name: str) -> Callable[[Any], None]:
    """Attach progress on stderr: a spinner with the state on a terminal, else one line per state change."""
    frames, started, last = itertools.cycle("|/-\\"), time.monotonic(), [None]

    def progress(cache) -> None:
        if out.interactive:
            out.note(f"\r{next(frames)} {name}: {cache.state} ({time.monotonic() - started:.0f} s)\x1b[K", end="")
        elif cache.state != last[0]:
            out.note(f"{name}: {cache.state}")
        last[0] = cache.state

    return progress


def cmd_attach(client, args, out: Out) -> None:
    spec = _spec_from_args(args)
    capacity = {"device": args.device_bytes, "dram": args.dram_bytes, "ssd": args.ssd_bytes}
    if args.network_bytes:
        capacity["network"] = args.network_bytes
    progress = None if args.no_wait or out.json_mode else _progress(out, args.name)
    try:
        cache = client.attach(
            args.name,
            spec,
            capacity,
            wait=not args.no_wait,
            timeout=args.timeout,
            progress=progress,
            network_write_through=args.network_write_through,
        )
    finally:
        if progress is not None and out.interactive:
            out.note("\r\x1b[K", end="")
    out.result(cache, lambda: _show_cache(cache))


def cmd_ls(client, args, out: Out) -> None:
    caches = client.list_caches(state=args.state)
    shown = caches if args.all or args.state else [c for c in caches if c.state not in HIDDEN_STATES]
    short = short_ids(c.id for c in caches)

    def human() -> str:
        headers = ["ID", "NAME", "STATE", "ENDPOINT", "DEVICE"]
        rows = [[short[c.id], c.name, c.state, c.endpoint, human_bytes(c.capacity.get("device"))] for c in shown]
        if not args.wide:
            return table(headers, rows, elidable=("NAME", "ENDPOINT"))
        headers += ["DRAM", "SSD", "NETWORK", "CREATED"]
        for row, c in zip(rows, shown):
            row[0] = c.id
            row += [human_bytes(c.capacity.get(tier)) for tier in ("dram", "ssd", "network")] + [when(c.created_at)]
        return table(headers, rows, width=None)

    out.result(shown, human)
    hidden = len(caches) - len(shown)
    if hidden and not out.json_mode:
        out.note(f"kcaas: {hidden} detached cache{'s' * (hidden > 1)} not shown: `kcaas ls --all` lists them")


def cmd_show(client, args, out: Out) -> None:
    cache = client.get_cache(cache_id(client, args.cache))
    out.result(cache, lambda: _show_cache(cache))


def cmd_detach(client, args, out: Out) -> None:
    cache = client.detach(cache_id(client, args.cache), wait=args.wait, timeout=args.timeout)
    out.result(cache, lambda: f"{cache.id} {cache.name}: {cache.state}")


def cmd_recover(client, args, out: Out) -> None:
    cache = client.recover(cache_id(client, args.cache), wait=args.wait, timeout=args.timeout)
    out.result(cache, lambda: f"{cache.id} {cache.name}: {cache.state} on node {cache.node_id} (epoch {cache.epoch})")


def cmd_token(client, args, out: Out) -> None:
    access = "read" if args.read_only else args.access
    token = client.issue_token(cache_id(client, args.cache), access=access, ttl_seconds=args.ttl)
    out.result(token, lambda: token.token)
    claims = token.claims()
    granted = claims.get("exp", 0) - claims.get("iat", 0) if "exp" in claims and "iat" in claims else None
    if args.ttl is not None and granted is not None and granted != args.ttl:
        out.note(f"kcaas: note: the server clamped --ttl {args.ttl} to {granted} s (its range: 60 s to its maximum)")
    if not out.json_mode:
        where = token.endpoint or "-"
        out.note(f"{token.access} token for {token.cache_id} at {where}, expires {when(token.expires_at)}")


def _keys_table(keys, wide: bool) -> str:
    short = short_ids(k.id for k in keys)
    if wide:
        wide_headers = ("ID", "NAME", "PUBLIC ID", "SCOPES", "STATE", "CREATED", "LAST USED", "EXPIRES")
        wide_rows = [
            [k.id, k.name, k.public_id, ",".join(k.scopes), k.state]
            + [when(k.created_at), when(k.last_used_at), when(k.expires_at)]
            for k in keys
        ]
        return table(wide_headers, wide_rows, width=None)
    headers = ("ID", "NAME", "SCOPES", "STATE", "LAST USED", "EXPIRES")
    rows = [
        [short[k.id], k.name, ",".join(k.scopes), k.state]
        + [when(k.last_used_at, seconds=False), when(k.expires_at, seconds=False)]
        for k in keys
    ]
    return table(headers, rows, elidable=("NAME", "SCOPES"))


def cmd_keys_ls(client, args, out: Out) -> None:
    keys = client.list_keys()
    out.result(keys, lambda: _keys_table(keys, args.wide))


def _issued(issued, out: Out, what: str) -> None:
    out.note(f"{what} {issued.id} ({','.join(issued.scopes)}). The secret below is shown this once: store it now.")
    out.result(issued, lambda: issued.key)


def cmd_keys_create(client, args, out: Out) -> None:
    scopes = [s.strip() for value in args.scope for s in value.split(",") if s.strip()]
    _issued(client.create_key(scopes, name=args.name, expires_in_seconds=args.expires_in), out, "Created key")


def cmd_keys_revoke(client, args, out: Out) -> None:
    key = client.revoke_key(key_id(client, args.key))
    out.result(key, lambda: f"{key.id}: {key.state} since {when(key.revoked_at)}")


def cmd_keys_rotate(client, args, out: Out) -> None:
    old = key_id(client, args.key)
    _issued(client.rotate_key(old, overlap_seconds=args.overlap), out, "Rotated to key")
    expires = client.get_key(old).expires_at  # the overlap, or the old key's own earlier expiry
    out.note(f"The old key {old} keeps working until {when(expires)}, then expires.")


def cmd_usage(client, args, out: Out) -> None:
    usage = client.usage()

    def human() -> str:
        rows = []
        for used, limit in QUOTA_PAIRS:
            fmt = human_bytes if used.endswith("_bytes") else str
            have, most = usage.used.get(used, 0), usage.limits.get(limit)
            share = f"{100 * have / most:.0f}%" if most else "-"
            rows.append((used.removesuffix("_bytes"), fmt(have), fmt(most) if most is not None else "-", share))
        lines = [table(("RESOURCE", "USED", "LIMIT", "USE"), rows)]
        lines.append(f"rate limit: {usage.limits.get('max_requests_per_second', '-')} requests/s")
        if usage.resident:
            resident = ", ".join(f"{k.removesuffix('_bytes')} {human_bytes(v)}" for k, v in usage.resident.items())
            lines.append(f"resident (last node reports): {resident}")
        return "\n".join(lines)

    out.result(usage, human)


# ---- the parser ------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse echoes arguments: never an API key
        super().error(KEY_SHAPE.sub(r"\1_***", message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kcaas",
        description="KCaaS command line: caches, data tokens, API keys, usage, engine instances;\n"
        "`kcaas admin`: tenants, their quotas and keys (platform administrators).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)  # the global options, also accepted after the subcommand
    for target, default in ((parser, None), (common, argparse.SUPPRESS)):
        target.add_argument("--url", default=default, help=f"control plane URL (KCAAS_URL; default {DEFAULT_URL})")
        target.add_argument("--api-key", default=default, help="tenant API key (KCAAS_API_KEY; never printed)")
        target.add_argument("--json", action="store_true", default=default or False, help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(sub, name: str, handler, help_text: str) -> argparse.ArgumentParser:
        made = sub.add_parser(name, parents=[common], help=help_text, description=help_text, epilog=EPILOG)
        made.formatter_class = argparse.RawDescriptionHelpFormatter
        made.set_defaults(handler=handler)
        return made

    attach = command(commands, "attach", cmd_attach, "attach a cache and wait until it is ready")
    attach.add_argument("name")
    attach.add_argument("--spec", metavar="FILE.json", help="the KV cache spec as JSON (flags override its fields)")
    attach.add_argument("--model-fingerprint")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        attach.add_argument("--" + name.replace("_", "-"), type=int)
    attach.add_argument("--block-size", type=int, help="tokens per block (default 16)")
    attach.add_argument("--kv-dtype", help="default float16")
    attach.add_argument("--storage-dtype", help="default: the kv dtype")
    attach.add_argument(
        "--attention", choices=("mha", "mla"), help="mla: latent KV (DeepSeek-V2/V3), with the two widths below"
    )
    attach.add_argument("--kv-lora-rank", type=int, help="mla: kv_c_normed width, e.g. 512")
    attach.add_argument("--qk-rope-head-dim", type=int, help="mla: k_pe width, e.g. 64")
    attach.add_argument("--device-bytes", type=parse_bytes, required=True, metavar="N", help="e.g. 2GiB")
    attach.add_argument("--dram-bytes", type=parse_bytes, default=0, metavar="N")
    attach.add_argument("--ssd-bytes", type=parse_bytes, default=0, metavar="N")
    attach.add_argument(
        "--network-bytes", type=parse_bytes, default=0, metavar="N", help="the fleet's network store (outlives a node)"
    )
    attach.add_argument(
        "--network-write-through",
        action="store_true",
        help="acknowledge a put once its full blocks are in the network store (needs --network-bytes)",
    )
    attach.add_argument("--no-wait", action="store_true", help="return once provisioning has started")
    attach.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait (default 60)")

    ls = command(commands, "ls", cmd_ls, "list the tenant's caches (detached ones only with --all)")
    ls.add_argument("--state", choices=("pending", "provisioning", "ready", "failed", "detaching", "detached"))
    ls.add_argument("--all", action="store_true", help="also the detached caches")
    ls.add_argument("--wide", action="store_true", help=f"full ids and every column (wider than {TABLE_WIDTH})")
    cache_help = "the cache: its id, name or id prefix"
    command(commands, "show", cmd_show, "one cache in full").add_argument("cache", help=cache_help)
    detach = command(commands, "detach", cmd_detach, "detach a cache (revokes its data tokens)")
    detach.add_argument("cache", help=cache_help)
    detach.add_argument("--wait", action="store_true", help="wait until it is detached")
    detach.add_argument("--timeout", type=float, default=60.0, metavar="S")
    recover = command(
        commands, "recover", cmd_recover, "re-place a cache whose node was lost, from its network tier (node_lost)"
    )
    recover.add_argument("cache", help=cache_help)
    recover.add_argument("--wait", action="store_true", help="wait until it is ready again")
    recover.add_argument("--timeout", type=float, default=60.0, metavar="S")
    token = command(commands, "token", cmd_token, "issue a data-plane token for a ready cache (printed on stdout)")
    token.add_argument("cache", help=cache_help)
    token.add_argument(
        "--access",
        choices=("read", "readwrite"),
        default="read",
        help="read (lookup, get: the default, as everywhere) or readwrite (also put, delete)",
    )
    token.add_argument("--read-only", action="store_true", help="the same as --access read")
    token.add_argument("--ttl", type=int, metavar="S", help="lifetime in seconds (clamped by the server: reported)")
    command(commands, "usage", cmd_usage, "quota limits against what the tenant uses")

    keys = commands.add_parser("keys", help="API keys", description="API keys of the tenant")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND", parser_class=_Parser)
    keys_ls = command(key_commands, "ls", cmd_keys_ls, "list the tenant's keys")
    keys_ls.add_argument("--wide", action="store_true", help="full ids, public ids and creation times")
    create = command(key_commands, "create", cmd_keys_create, "create a key (its secret is printed once)")
    create.add_argument("--scope", action="append", required=True, help="e.g. caches:write (repeat, or comma-separate)")
    create.add_argument("--name", default="")
    create.add_argument("--expires-in", type=int, metavar="S", help="seconds until it expires (default: never)")
    key_help = "the key: its id, id prefix, name or public id"
    command(key_commands, "revoke", cmd_keys_revoke, "revoke a key now").add_argument("key", help=key_help)
    rotate = command(key_commands, "rotate", cmd_keys_rotate, "a successor key; the old one works for the overlap")
    rotate.add_argument("key", help=key_help)
    rotate.add_argument("--overlap", type=int, metavar="S", help="seconds the old key keeps working")
    add_engine_commands(commands, command, _Parser)
    add_admin_commands(commands, command, _Parser, _keys_table)
    return parser


# ---- the entry point -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring) instead of raising SystemExit.

    A reader that closes stdout early (`| head`) ends the command quietly with EXIT_CLOSED_PIPE: stdout is flushed
    here, inside the guard, so the interpreter's own flush at exit has nothing left to fail on."""
    try:
        code = _run(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_CLOSED_PIPE


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that nothing (the exit's flush included) writes to the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (a test's capture): nothing will flush into a pipe
        pass
    finally:
        os.close(devnull)


def _client(url: str, api_key: str) -> Client:
    if not api_key:
        raise UsageError("no API key: set KCAAS_API_KEY or pass --api-key")
    try:
        return Client(url, api_key, retry_budget=INTERACTIVE_RETRY_BUDGET_SECONDS)
    except ValueError as exc:
        raise UsageError(f"{exc} (got --url/KCAAS_URL {url!r})") from None


def _run(argv: Sequence[str] | None) -> int:
    """Parse argv and run its command: the exit code, with every failure but a closed stdout reported."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    url = args.url or os.environ.get("KCAAS_URL") or DEFAULT_URL
    admin = getattr(args, "admin", False)
    api_key = args.api_key or os.environ.get("KCAAS_API_KEY") or ""
    password = os.environ.get("KCAAS_ADMIN_PASSWORD", "").strip() if admin else ""
    out = Out(args.json, password if admin else api_key)  # the secret in use is scrubbed from stderr
    try:
        client = admin_client(url, password, INTERACTIVE_RETRY_BUDGET_SECONDS) if admin else _client(url, api_key)
        with client:
            try:
                args.handler(client, args, out)
            except _UNREADABLE as exc:  # a success answer that is not the API's JSON
                raise unreadable_answer(exc, url) from None
        return EXIT_OK
    except UsageError as exc:
        out.note(f"kcaas: error: {exc}")
        return EXIT_USAGE
    except KcaasError as exc:
        return report(out, with_admin_hint(exc) if admin else exc, url)
    except KeyboardInterrupt:
        out.note("\ninterrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover - `python -m kcaas` goes through kcaas/__main__.py
    sys.exit(main())
