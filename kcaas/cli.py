"""The `kcaas` command line: caches, data tokens, API keys and usage over kcaas.Client.

    kcaas attach chat --model-fingerprint llama-3-8b@main --num-layers 32 --num-kv-heads 8 --head-dim 128 \\
        --device-bytes 2GiB
    kcaas ls
    kcaas usage --json

Configuration: `--url` / KCAAS_URL (default http://127.0.0.1:8000, what `make up` serves) and `--api-key` /
KCAAS_API_KEY. The key is never printed: every line written to stderr is scrubbed of it (and of anything shaped like
a KCaaS key), and the SDK keeps it out of its errors.

Output: tables and `name: value` lines on stdout, progress, warnings and errors on stderr; `--json` (anywhere on the
line) prints one JSON document on stdout instead, and an error as `{"error": {...}}` on stderr.

Exit codes: 0 done; 1 the API refused or a cache failed (`error: <code>: <message>`, plus a hint where one is
obvious); 2 a usage error (argparse, an unreadable spec file, no API key); 3 no connection to the control plane;
130 interrupted. Expected failures never print a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from kcaas.client import Client
from kcaas.errors import APIConnectionError, KcaasError
from kcaas.spec import KVCacheSpec, SpecError
from kcaas.usage import QUOTA_PAIRS

DEFAULT_URL = "http://127.0.0.1:8000"
# A person waits at the prompt: the CLI rides out a blip of a few seconds, not the SDK's 30 s outage budget.
INTERACTIVE_RETRY_BUDGET_SECONDS = 5.0
EXIT_OK, EXIT_API, EXIT_USAGE, EXIT_CONNECTION, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(KVCacheSpec))
SPEC_DEFAULTS = {"block_size": 16, "kv_dtype": "float16"}  # storage_dtype defaults to kv_dtype
_KEY_SHAPE = re.compile(r"\b(kc_[a-z]{1,16}_[0-9A-Za-z]+)_[0-9A-Za-z]+")  # core/keys.py: prefix_public_secret
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS.update({f"{u}ib": v for u, v in _UNITS.items() if u not in ("", "b")})
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


class UsageError(Exception):
    """Bad input found after argparse (a spec file, a missing key): exit 2."""


# ---- formatting ------------------------------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """`1048576`, `512MiB`, `2G` (K/M/G/T and KiB.. are powers of 1024; kB/MB/GB/TB of 1000) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1048576, 512MiB, 2GiB)")
    return int(float(match.group(1)) * unit)


def human_bytes(value: int | None) -> str:
    """1536 -> `1.5 KiB`; exact below 1 KiB."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _when(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers)] + [["-" if v in (None, "") else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class _Out:
    """Where a command writes: stdout for results, stderr (scrubbed of the API key) for everything else."""

    def __init__(self, json_mode: bool, api_key: str | None) -> None:
        self.json_mode = json_mode
        self._api_key = api_key
        self.interactive = sys.stderr.isatty()

    def scrub(self, text: str) -> str:
        key = self._api_key or ""
        if len(key) >= 8:  # (a shorter "key" is no secret, and would garble the text)
            text = text.replace(key, "***")
        return _KEY_SHAPE.sub(r"\1_***", text)

    def result(self, data: Any, human: Callable[[], str]) -> None:
        text = json.dumps(_jsonable(data), indent=2, sort_keys=True) if self.json_mode else human()
        if text:
            print(text, file=sys.stdout, flush=True)

    def note(self, text: str, *, end: str = "\n") -> None:
        print(self.scrub(text), end=end, file=sys.stderr, flush=True)


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
    missing = [name for name in SPEC_FIELDS if name not in fields]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise UsageError(f"the KV cache spec lacks {flags} (or give --spec FILE.json)")
    try:
        return KVCacheSpec(**fields)
    except (SpecError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _show_cache(cache) -> str:
    spec = cache.spec
    lines = [
        ("id", cache.id),
        ("name", cache.name),
        ("state", cache.state + (f" ({cache.failure_reason})" if cache.failure_reason else "")),
        ("node", cache.node_id or "-"),
        ("endpoint", cache.endpoint or "-"),
        ("epoch", cache.epoch),
        ("capacity", ", ".join(f"{tier} {human_bytes(b)}" for tier, b in cache.capacity.items() if b) or "-"),
        ("block bytes", cache.block_bytes),
        ("spec", ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(spec).items()) if spec else "-"),
        ("created", _when(cache.created_at)),
        ("updated", _when(cache.updated_at)),
    ]
    return "\n".join(f"{name + ':':<13}{value}" for name, value in lines)


def _progress(out: _Out, name: str) -> Callable[[Any], None]:
    """Attach progress on stderr: a spinner with the state on a terminal, else one line per state change."""
    frames, started, last = itertools.cycle("|/-\\"), time.monotonic(), [None]

    def report(cache) -> None:
        if out.interactive:
            out.note(f"\r{next(frames)} {name}: {cache.state} ({time.monotonic() - started:.0f} s)\x1b[K", end="")
        elif cache.state != last[0]:
            out.note(f"{name}: {cache.state}")
        last[0] = cache.state

    return report


def cmd_attach(client, args, out: _Out) -> None:
    spec = _spec_from_args(args)
    capacity = {"device": args.device_bytes, "dram": args.dram_bytes, "ssd": args.ssd_bytes}
    report = None if args.no_wait or out.json_mode else _progress(out, args.name)
    try:
        cache = client.attach(args.name, spec, capacity, wait=not args.no_wait, timeout=args.timeout, progress=report)
    finally:
        if report is not None and out.interactive:
            out.note("\r\x1b[K", end="")
    out.result(cache, lambda: _show_cache(cache))


def cmd_ls(client, args, out: _Out) -> None:
    caches = client.list_caches(state=args.state)
    rows = [(c.id, c.name, c.state, c.endpoint, human_bytes(c.capacity.get("device"))) for c in caches]
    out.result(caches, lambda: _table(("ID", "NAME", "STATE", "ENDPOINT", "DEVICE"), rows))


def cmd_show(client, args, out: _Out) -> None:
    cache = client.get_cache(args.cache_id)
    out.result(cache, lambda: _show_cache(cache))


def cmd_detach(client, args, out: _Out) -> None:
    cache = client.detach(args.cache_id, wait=args.wait, timeout=args.timeout)
    out.result(cache, lambda: f"{cache.id} {cache.name}: {cache.state}")


def cmd_token(client, args, out: _Out) -> None:
    token = client.issue_token(args.cache_id, access="read" if args.read_only else "readwrite", ttl_seconds=args.ttl)
    out.result(token, lambda: token.token)
    if not out.json_mode:
        where = token.endpoint or "-"
        out.note(f"{token.access} token for {token.cache_id} at {where}, expires {_when(token.expires_at)}")


def _key_rows(keys) -> list[tuple]:
    return [
        (
            k.id,
            k.name,
            k.public_id,
            ",".join(k.scopes),
            k.state,
            _when(k.created_at),
            _when(k.last_used_at),
            _when(k.expires_at),
        )
        for k in keys
    ]


def cmd_keys_ls(client, args, out: _Out) -> None:
    keys = client.list_keys()
    headers = ("ID", "NAME", "PUBLIC ID", "SCOPES", "STATE", "CREATED", "LAST USED", "EXPIRES")
    out.result(keys, lambda: _table(headers, _key_rows(keys)))


def _issued(issued, out: _Out, what: str) -> None:
    out.note(f"{what} {issued.id} ({','.join(issued.scopes)}). The secret below is shown this once: store it now.")
    out.result(issued, lambda: issued.key)


def cmd_keys_create(client, args, out: _Out) -> None:
    scopes = [s.strip() for value in args.scope for s in value.split(",") if s.strip()]
    _issued(client.create_key(scopes, name=args.name, expires_in_seconds=args.expires_in), out, "Created key")


def cmd_keys_revoke(client, args, out: _Out) -> None:
    key = client.revoke_key(args.key_id)
    out.result(key, lambda: f"{key.id}: {key.state} since {_when(key.revoked_at)}")


def cmd_keys_rotate(client, args, out: _Out) -> None:
    _issued(client.rotate_key(args.key_id, overlap_seconds=args.overlap), out, "Rotated to key")
    out.note(f"The old key {args.key_id} keeps working for the overlap (server default 1 h), then expires.")


def cmd_usage(client, args, out: _Out) -> None:
    usage = client.usage()

    def human() -> str:
        rows = []
        for used, limit in QUOTA_PAIRS:
            fmt = human_bytes if used.endswith("_bytes") else str
            have, most = usage.used.get(used, 0), usage.limits.get(limit)
            share = f"{100 * have / most:.0f}%" if most else "-"
            rows.append((used.removesuffix("_bytes"), fmt(have), fmt(most) if most is not None else "-", share))
        lines = [_table(("RESOURCE", "USED", "LIMIT", "USE"), rows)]
        lines.append(f"rate limit: {usage.limits.get('max_requests_per_second', '-')} requests/s")
        if usage.resident:
            resident = ", ".join(f"{k.removesuffix('_bytes')} {human_bytes(v)}" for k, v in usage.resident.items())
            lines.append(f"resident (last node reports): {resident}")
        return "\n".join(lines)

    out.result(usage, human)


# ---- the parser ------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse echoes arguments: never an API key
        super().error(_KEY_SHAPE.sub(r"\1_***", message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kcaas", description="KCaaS command line: caches, data tokens, API keys, usage.")
    common = argparse.ArgumentParser(add_help=False)  # the global options, also accepted after the subcommand
    for target, default in ((parser, None), (common, argparse.SUPPRESS)):
        target.add_argument("--url", default=default, help=f"control plane URL (KCAAS_URL; default {DEFAULT_URL})")
        target.add_argument("--api-key", default=default, help="tenant API key (KCAAS_API_KEY; never printed)")
        target.add_argument("--json", action="store_true", default=default or False, help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(sub, name: str, handler, help_text: str) -> argparse.ArgumentParser:
        made = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
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
    attach.add_argument("--device-bytes", type=parse_bytes, required=True, metavar="N", help="e.g. 2GiB")
    attach.add_argument("--dram-bytes", type=parse_bytes, default=0, metavar="N")
    attach.add_argument("--ssd-bytes", type=parse_bytes, default=0, metavar="N")
    attach.add_argument("--no-wait", action="store_true", help="return once provisioning has started")
    attach.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait (default 60)")

    ls = command(commands, "ls", cmd_ls, "list the tenant's caches")
    ls.add_argument("--state", choices=("pending", "provisioning", "ready", "failed", "detaching", "detached"))
    command(commands, "show", cmd_show, "one cache in full").add_argument("cache_id")
    detach = command(commands, "detach", cmd_detach, "detach a cache (revokes its data tokens)")
    detach.add_argument("cache_id")
    detach.add_argument("--wait", action="store_true", help="wait until it is detached")
    detach.add_argument("--timeout", type=float, default=60.0, metavar="S")
    token = command(commands, "token", cmd_token, "issue a data-plane token for a ready cache (printed on stdout)")
    token.add_argument("cache_id")
    token.add_argument("--read-only", action="store_true", help="read access only (default: readwrite)")
    token.add_argument("--ttl", type=int, metavar="S", help="lifetime in seconds (the server clamps it)")
    command(commands, "usage", cmd_usage, "quota limits against what the tenant uses")

    keys = commands.add_parser("keys", help="API keys", description="API keys of the tenant")
    key_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND", parser_class=_Parser)
    command(key_commands, "ls", cmd_keys_ls, "list the tenant's keys")
    create = command(key_commands, "create", cmd_keys_create, "create a key (its secret is printed once)")
    create.add_argument("--scope", action="append", required=True, help="e.g. caches:write (repeat, or comma-separate)")
    create.add_argument("--name", default="")
    create.add_argument("--expires-in", type=int, metavar="S", help="seconds until it expires (default: never)")
    command(key_commands, "revoke", cmd_keys_revoke, "revoke a key now").add_argument("key_id")
    rotate = command(key_commands, "rotate", cmd_keys_rotate, "a successor key; the old one works for the overlap")
    rotate.add_argument("key_id")
    rotate.add_argument("--overlap", type=int, metavar="S", help="seconds the old key keeps working")
    return parser


# ---- errors and the entry point --------------------------------------------------------------------------------------


def _hint(exc: KcaasError, url: str) -> str | None:
    if isinstance(exc, APIConnectionError):
        return f"is `make up` running at {url}? (set --url or KCAAS_URL)"
    if exc.status == 401:
        return "check KCAAS_API_KEY (or --api-key): the key is missing, unknown, revoked or expired"
    if exc.code == "permission_denied" and exc.details.get("required_scope"):
        return f"this key lacks {exc.details['required_scope']}: use a key that holds it"
    if exc.code == "quota_exceeded":
        return "see `kcaas usage`; detach caches you no longer need"
    retry_after = getattr(exc, "retry_after", None)
    if exc.code == "rate_limited" and retry_after is not None:
        return f"retry after {retry_after:.1f} s"
    cache = getattr(exc, "cache", None)
    if exc.code == "cache_failed" and cache is not None:
        return f"detach it to free its quota: kcaas detach {cache.id}"
    if exc.code == "wait_timeout" and cache is not None:
        return f"it may still become ready: kcaas show {cache.id}"
    return None


def _report(out: _Out, exc: KcaasError, url: str) -> int:
    hint = _hint(exc, url)
    if out.json_mode:
        body = {"code": exc.code, "message": exc.message, "status": exc.status, "details": exc.details}
        out.note(json.dumps({"error": {**_jsonable(body), **({"hint": hint} if hint else {})}}))
    else:
        out.note(f"error: {exc.code}: {exc.message}" + (f"\nhint: {hint}" if hint else ""))
    return EXIT_CONNECTION if isinstance(exc, APIConnectionError) else EXIT_API


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring) instead of raising SystemExit."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    url = args.url or os.environ.get("KCAAS_URL") or DEFAULT_URL
    api_key = args.api_key or os.environ.get("KCAAS_API_KEY") or ""
    out = _Out(args.json, api_key)
    try:
        if not api_key:
            raise UsageError("no API key: set KCAAS_API_KEY or pass --api-key")
        try:
            client = Client(url, api_key, retry_budget=INTERACTIVE_RETRY_BUDGET_SECONDS)
        except ValueError as exc:
            raise UsageError(f"{exc} (got --url/KCAAS_URL {url!r})") from None
        with client:
            args.handler(client, args, out)
        return EXIT_OK
    except UsageError as exc:
        out.note(f"kcaas: error: {exc}")
        return EXIT_USAGE
    except KcaasError as exc:
        return _report(out, exc, url)
    except KeyboardInterrupt:
        out.note("\ninterrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover - `python -m kcaas` goes through kcaas/__main__.py
    sys.exit(main())
