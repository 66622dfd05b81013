"""How the `kcaas` command line (kcaas/cli.py) reports a failure: one `error: <code>: <message>` line, the details
(field -> problems, one indented line each), and a `hint:` saying what to do. Every answer of the server gets one,
also answers that are not the KCaaS API's (an HTML page, a proxy's 502, text where JSON was due): those become
`not_kcaas_api`, naming the URL. `--json` writes `{"error": {code, message, status, details, hint}}` instead."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Mapping
from typing import Any

from kcaas.cli_output import Out, jsonable
from kcaas.errors import APIConnectionError, KcaasError, hint_for
from kcaas.units import human_bytes

EXIT_API, EXIT_CONNECTION = 1, 3
URL_HINT = "set KCAAS_URL or --url to the control plane's URL (`make up` serves http://127.0.0.1:8000)"
KEY_HINT = "check KCAAS_API_KEY (or --api-key): the key is missing, unknown, revoked or expired"
_MAX_MESSAGE = 300
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class UsageError(Exception):
    """Bad input found after argparse (a spec file, a missing key): exit 2."""


class UnexpectedAnswer(KcaasError):
    """An answer the KCaaS API would not give: not its JSON error envelope, or a success body the SDK cannot read."""

    default_code = "not_kcaas_api"


def one_line(text: str, limit: int = _MAX_MESSAGE) -> str:
    """Whitespace collapsed, control characters (a TLS record read as HTTP) shown as `?`, cut at `limit`."""
    text = " ".join(_CONTROL.sub("?", text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def enveloped(exc: KcaasError) -> bool:
    """False when an error answer lacked the API's `{"error": {...}}` envelope. The SDK then keeps the class's
    default code, no details, and as message the body's text or, for a body that is empty or other JSON, the
    status's reason phrase; the API's own messages are single sentences, never markup nor a bare reason phrase."""
    if exc.status is None or exc.details or exc.code != type(exc).default_code:
        return True
    message = exc.message
    reason = http.client.responses.get(exc.status, "HTTP error")
    return not (message == reason or "<" in message or "\n" in message or len(message) > 200)


def not_the_api(exc: KcaasError, url: str) -> UnexpectedAnswer:
    """The answer of a server that is not the KCaaS API (or a gateway in front of it), as one error."""
    status = exc.status or 0
    reason = http.client.responses.get(status, "")
    what = "an HTML page" if "<" in exc.message else "no KCaaS error"
    return UnexpectedAnswer(
        f"{url} is not answering as the KCaaS API: HTTP {status} {reason} with {what}",
        status=exc.status,
        request_id=exc.request_id,
    )


def unreadable_answer(exc: Exception, url: str) -> UnexpectedAnswer:
    """A success answer whose body is not the API's JSON (a web page, other JSON)."""
    why = one_line(f"{type(exc).__name__}: {exc}", 120)
    return UnexpectedAnswer(f"{url} is not answering as the KCaaS API: its answer is unreadable ({why})")


def detail_lines(details: Any, prefix: str = "") -> list[str]:
    """`{"fields": {"spec": {"num_layers": ["Too big."]}}, "limit": "max_caches"}` -> `spec.num_layers: Too big.`,
    `limit: max_caches` (the `fields` wrapper of validation errors is left out)."""
    if isinstance(details, Mapping):
        lines = []
        for key, value in details.items():
            name = "" if key == "fields" and not prefix else f"{prefix}.{key}" if prefix else str(key)
            lines += detail_lines(value, name)
        return lines
    if isinstance(details, (list, tuple)):
        if all(not isinstance(v, (Mapping, list, tuple)) for v in details):  # problems: one line each
            return [f"{prefix}: {one_line(str(v))}" if prefix else one_line(str(v)) for v in details]
        return [line for i, v in enumerate(details) for line in detail_lines(v, f"{prefix}[{i}]")]
    if _is_byte_count(prefix, details):
        details = f"{details} ({human_bytes(details)})"  # the exact bytes a program reads, the size a person reads
    return [f"{prefix}: {one_line(str(details))}" if prefix else one_line(str(details))]


BYTE_MAPS = ("requested.", "largest_free.", "capacity.")  # details that map tiers to bytes


def _is_byte_count(path: str, value: Any) -> bool:
    """A detail that is a byte count: an integer under a tier -> bytes map, or named *_bytes."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return path.startswith(BYTE_MAPS) or path.rsplit(".", 1)[-1].endswith("_bytes")


def hint(exc: KcaasError, url: str) -> str:
    """What to do about `exc`: always something (report() prefers a `hint` the server put in the details)."""
    if isinstance(exc, APIConnectionError):
        tls = "https://" if any(s in exc.message for s in ("BadStatusLine", "SSL", "Connection reset")) else ""
        also = " (if it speaks TLS, use an https:// URL)" if tls and url.startswith("http://") else ""
        return f"is `make up` running at {url}?{also} Otherwise {URL_HINT}"
    if isinstance(exc, UnexpectedAnswer):
        if exc.status is not None and exc.status >= 500:
            return f"a gateway at {url} failed: is the control plane behind it running (`make up`)? Or {URL_HINT}"
        return f"is {url} the KCaaS control plane? {URL_HINT}"
    for known in (_auth_hint, _state_hint, _refusal_hint):
        found = known(exc)
        if found:
            return found
    if exc.status is not None and exc.status >= 500:
        tail = f" (request id {exc.request_id})" if exc.request_id else ""
        return f"the control plane at {url} failed; try again shortly, and report it if it persists{tail}"
    return "see `kcaas --help` and `kcaas COMMAND --help`"


def _auth_hint(exc: KcaasError) -> str | None:
    if exc.status == 401:
        return KEY_HINT
    if exc.code == "permission_denied":
        scope = exc.details.get("required_scope")
        return f"this key lacks {scope}: use a key that holds it" if scope else "use a key with the scopes this needs"
    if exc.code == "quota_exceeded":
        return "see `kcaas usage`; detach caches you no longer need"
    retry_after = getattr(exc, "retry_after", None)
    if exc.code == "rate_limited":
        return f"retry after {retry_after:.1f} s" if retry_after is not None else "slow down, then retry"
    return None


def _state_hint(exc: KcaasError) -> str | None:
    cache = getattr(exc, "cache", None)
    if exc.code == "cache_failed" and cache is not None:
        return f"detach it to free its quota: kcaas detach {cache.id}"
    if exc.code == "wait_timeout" and cache is not None:
        return f"it may still become ready: kcaas show {cache.id}"
    if exc.code == "cache_not_ready":
        return "wait until it is ready (kcaas show NAME shows its state), then try again"
    if exc.code == "cache_name_taken":
        return hint_for(exc.code, exc.message, exc.details)
    if exc.code == "ambiguous":
        return "name it by id, or by an id prefix long enough to be unique"
    if exc.status == 404 or exc.code == "not_found":
        return "`kcaas ls --all` lists every cache, `kcaas keys ls` the keys; names and id prefixes are accepted"
    return None


def _refusal_hint(exc: KcaasError) -> str | None:
    if exc.status in (400, 413, 422):
        return "fix what the details name and run it again; `kcaas COMMAND --help` lists the options"
    if exc.code == "no_capacity":
        return "ask for less capacity (see the details), or give the nodes more"
    if exc.status == 409:
        return "the resource's state does not allow this now: look at it (kcaas show / kcaas keys ls) and retry"
    return None


def report(out: Out, exc: KcaasError, url: str) -> int:
    """Write `exc` to stderr (human or JSON); returns the exit code: 3 without a usable answer, else 1. A `hint`
    in the details (the server's advice) becomes the hint line."""
    if exc.status is not None and not enveloped(exc):
        exc = not_the_api(exc, url)
    server_hint = exc.details.get("hint")
    advice = server_hint if isinstance(server_hint, str) and server_hint else hint(exc, url)
    details = {k: v for k, v in exc.details.items() if k != "hint" or v is not server_hint}
    message = one_line(exc.message)
    if isinstance(exc, APIConnectionError) and url not in message:
        message = f"{url}: {message}"
    if out.json_mode:
        body = {"code": exc.code, "message": message, "status": exc.status, "details": exc.details, "hint": advice}
        body["request_id"] = exc.request_id
        out.note(json.dumps({"error": jsonable(body)}))
    else:
        lines = [f"error: {exc.code}: {message}", *(f"  {line}" for line in detail_lines(details))]
        out.note("\n".join([*lines, f"hint: {advice}"]))
    unusable = isinstance(exc, (APIConnectionError, UnexpectedAnswer))
    return EXIT_CONNECTION if unusable else EXIT_API
