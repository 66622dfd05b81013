"""`kcaas admin ...`: tenant onboarding for platform administrators, over kcaas.admin() (kcaas/client_admin.py).
The commands and their flags: ADMIN_DESCRIPTION and ADMIN_EPILOG below (what `kcaas admin -h` prints) and
docs/admin-cli.md.

Credentials: HTTP basic as KCAAS_ADMIN_USER (default admin) with KCAAS_ADMIN_PASSWORD; the password is never printed.
`keys create` prints the secret once on stdout, then `export KCAAS_URL=... KCAAS_API_KEY=...` for the tenant's shell.
Output, `--json` and exit codes are the other commands' (kcaas/cli.py): a refused password is 1 with the API's code
(`authentication_failed`), no password at all a usage error (2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from kcaas.cli_errors import UsageError
from kcaas.cli_output import Out, human_bytes, parse_bytes, table, when
from kcaas.cli_resolve import key_id
from kcaas.client_admin import ALL_SCOPES, DEFAULT_ADMIN_USER, PASSWORD_HINT, AdminClient, Tenant, admin_auth_hint
from kcaas.errors import KcaasError

ADMIN_EPILOG = """\
environment:
  KCAAS_URL             the control plane's URL, as --url (default http://127.0.0.1:8000)
  KCAAS_ADMIN_USER      a platform administrator (default admin)
  KCAAS_ADMIN_PASSWORD  its password (`make up` prints it and writes var/secrets/admin-password)

tenants are taken by name or id; sizes as 8GiB, 512MiB or bytes; `default` resets a limit.
exit codes: 0 done, 1 refused by the API, 2 usage error, 3 no usable answer from --url."""


ADMIN_DESCRIPTION = """\
tenant onboarding for platform administrators (kcaas.admin(), HTTP basic):

  kcaas admin tenants create acme --device-bytes 8GiB --dram-bytes 32GiB
  kcaas admin tenants ls
  kcaas admin tenants show acme                   # NAME_OR_ID, with its quota
  kcaas admin tenants quota acme --device-bytes 16GiB --caches default
  kcaas admin tenants suspend acme                # and: reactivate acme
  kcaas admin keys create --tenant acme --name onboarding [--scope caches:write,usage:read]
  kcaas admin keys ls --tenant acme
  kcaas admin keys revoke KEY --tenant acme

Quota flags are the API's limits without `max_` (--caches, --device-bytes, ...); sizes take
units (512MiB, 8GiB); `default` resets a limit. `keys create` prints the secret once, then
the tenant's `export KCAAS_URL=... KCAAS_API_KEY=...` line."""


def _limit_value(parse: Callable[[str], int]) -> Callable[[str], int | None]:
    def convert(text: str) -> int | None:
        return None if text.strip().lower() == "default" else parse(text)

    return convert


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


# flag (the API's limit without max_) -> (limit, value parser, help)
QUOTA_FLAGS = {
    "caches": ("max_caches", _count, "caches attached at once"),
    "device-bytes": ("max_device_bytes", parse_bytes, "device (GPU) memory, e.g. 8GiB"),
    "dram-bytes": ("max_dram_bytes", parse_bytes, "host memory, e.g. 32GiB"),
    "ssd-bytes": ("max_ssd_bytes", parse_bytes, "SSD tier, e.g. 1TiB"),
    "network-bytes": ("max_network_bytes", parse_bytes, "the fleet's network store"),
    "requests-per-second": ("max_requests_per_second", _count, "API rate limit"),
    "data-tokens-outstanding": ("max_data_tokens_outstanding", _count, "data-plane tokens not yet expired"),
    "api-keys": ("max_api_keys", _count, "usable API keys"),
}


def admin_client(url: str, password: str, retry_budget: float) -> AdminClient:
    """The AdminClient for `url` as KCAAS_ADMIN_USER; UsageError when there is no password or `url` is no URL."""
    if not password:
        raise UsageError(f"no admin password: {PASSWORD_HINT}")
    user = os.environ.get("KCAAS_ADMIN_USER", "").strip() or DEFAULT_ADMIN_USER
    try:
        return AdminClient(url, user, password, retry_budget=retry_budget)
    except ValueError as exc:
        raise UsageError(f"{exc} (got --url/KCAAS_URL {url!r})") from None


def with_admin_hint(exc: KcaasError) -> KcaasError:
    """`exc` with an administrator's hint (a refused password names KCAAS_ADMIN_PASSWORD, not KCAAS_API_KEY) where
    one applies: cli_errors.report() takes a hint from the details."""
    advice = admin_auth_hint(exc)
    if advice and not isinstance(exc.details.get("hint"), str):
        exc.details = {**exc.details, "hint": advice}
    return exc


def _limits(args: argparse.Namespace) -> dict[str, int | None]:
    """The quota flags given, as the API's limits (None: back to the default)."""
    given: dict[str, int | None] = {}
    for flag, (limit, _parse, _help) in QUOTA_FLAGS.items():
        name = "quota_" + flag.replace("-", "_")
        if hasattr(args, name):  # absent unless given (argparse.SUPPRESS)
            given[limit] = getattr(args, name)
    return given


def _show_tenant(tenant: Tenant) -> str:
    lines = [f"{'id:':<9}{tenant.id}", f"{'name:':<9}{tenant.name}", f"{'status:':<9}{tenant.status}"]
    lines.append(f"{'created:':<9}{when(tenant.created_at)}")
    if tenant.quota is not None:
        rows = []
        for flag, (limit, parse, _help) in QUOTA_FLAGS.items():
            value = tenant.quota.limits.get(limit)
            shown = "-" if value is None else human_bytes(value) if parse is parse_bytes else str(value)
            overridden = tenant.quota.overrides.get(limit) is not None
            rows.append([flag, shown, "set" if overridden else "default"])
        lines += ["quota:", *("  " + line for line in table(("LIMIT", "VALUE", "SOURCE"), rows).splitlines())]
    return "\n".join(lines)


# ---- commands --------------------------------------------------------------------------------------------------------


def cmd_tenants_create(client: AdminClient, args, out: Out) -> None:
    tenant = client.create_tenant(args.name, **_limits(args))
    out.result(tenant, lambda: _show_tenant(tenant))


def cmd_tenants_ls(client: AdminClient, args, out: Out) -> None:
    tenants = client.list_tenants()
    rows = [[t.id, t.name, t.status, when(t.created_at, seconds=False)] for t in tenants]
    out.result(tenants, lambda: table(("ID", "NAME", "STATUS", "CREATED"), rows, elidable=("NAME",)))


def cmd_tenants_show(client: AdminClient, args, out: Out) -> None:
    tenant = client.get_tenant(args.tenant)
    out.result(tenant, lambda: _show_tenant(tenant))


def cmd_tenants_quota(client: AdminClient, args, out: Out) -> None:
    limits = _limits(args)
    tenant_id = client.tenant_id(args.tenant)
    if limits:
        client.set_quota(tenant_id, **limits)
    tenant = client.get_tenant(tenant_id)
    out.result(tenant, lambda: _show_tenant(tenant))


def cmd_tenants_suspend(client: AdminClient, args, out: Out) -> None:
    tenant = client.suspend(args.tenant)
    out.result(tenant, lambda: f"{tenant.id} {tenant.name}: {tenant.status} (its keys are refused until reactivated)")


def cmd_tenants_reactivate(client: AdminClient, args, out: Out) -> None:
    tenant = client.reactivate(args.tenant)
    out.result(tenant, lambda: f"{tenant.id} {tenant.name}: {tenant.status}")


def cmd_keys_create(client: AdminClient, args, out: Out) -> None:
    scopes = [s.strip() for value in args.scope or () for s in value.split(",") if s.strip()] or list(ALL_SCOPES)
    tenant_id = client.tenant_id(args.tenant)
    issued = client.create_key(tenant_id, scopes, name=args.name, expires_in_seconds=args.expires_in)
    out.note(
        f"Created key {issued.id} for tenant {args.tenant} ({','.join(issued.scopes)}). "
        "The secret below is shown this once: store it now."
    )
    out.result(issued, lambda: f"{issued.key}\nexport KCAAS_URL={client.base_url} KCAAS_API_KEY={issued.key}")


class _TenantKeys:
    """One tenant's keys, as kcaas.cli_resolve.key_id asks a client for them."""

    def __init__(self, client: AdminClient, tenant_id: str) -> None:
        self._client, self._tenant_id = client, tenant_id

    def list_keys(self):
        return self._client.list_keys(self._tenant_id)


def cmd_keys_ls(client: AdminClient, args, out: Out) -> None:
    keys = client.list_keys(args.tenant)
    out.result(keys, lambda: args.keys_table(keys, args.wide))


def cmd_keys_revoke(client: AdminClient, args, out: Out) -> None:
    tenant_id = client.tenant_id(args.tenant)
    key = client.revoke_key(tenant_id, key_id(_TenantKeys(client, tenant_id), args.key))
    out.result(key, lambda: f"{key.id}: {key.state} since {when(key.revoked_at)}")


# ---- the parser ------------------------------------------------------------------------------------------------------


def _quota_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quota (the platform default where not given; `default` resets one)")
    for flag, (_limit, parse, help_text) in QUOTA_FLAGS.items():
        group.add_argument(
            "--" + flag,
            dest="quota_" + flag.replace("-", "_"),
            type=_limit_value(parse),
            default=argparse.SUPPRESS,
            metavar="N",
            help=help_text,
        )


def add_admin_commands(
    commands, command: Callable[..., argparse.ArgumentParser], parser_class, keys_table: Callable[..., str]
) -> None:
    """`kcaas admin tenants ...|keys ...` under `commands` (command: kcaas.cli's subcommand maker; keys_table: the
    table `kcaas keys ls` prints, which `kcaas admin keys ls` prints too)."""
    admin = commands.add_parser(
        "admin",
        help="platform administration: tenants, quotas, their keys (HTTP basic)",
        description=ADMIN_DESCRIPTION,
        epilog=ADMIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = admin.add_subparsers(dest="admin_group", required=True, metavar="GROUP", parser_class=parser_class)

    def admin_command(sub, name: str, handler, help_text: str) -> argparse.ArgumentParser:
        made = command(sub, name, handler, help_text)
        made.epilog = ADMIN_EPILOG
        made.set_defaults(admin=True)
        return made

    tenants = groups.add_parser("tenants", help="tenants and their quotas", description="tenants and their quotas")
    sub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="COMMAND", parser_class=parser_class)
    create = admin_command(sub, "create", cmd_tenants_create, "create a tenant, with its quota")
    create.add_argument("name")
    _quota_flags(create)
    admin_command(sub, "ls", cmd_tenants_ls, "list the tenants")
    tenant_help = "the tenant: its name or id"
    admin_command(sub, "show", cmd_tenants_show, "one tenant with its quota").add_argument("tenant", help=tenant_help)
    quota = admin_command(sub, "quota", cmd_tenants_quota, "set a tenant's quota limits (none given: show them)")
    quota.add_argument("tenant", help=tenant_help)
    _quota_flags(quota)
    suspend = admin_command(sub, "suspend", cmd_tenants_suspend, "suspend a tenant (its keys are refused)")
    suspend.add_argument("tenant", help=tenant_help)
    reactivate = admin_command(sub, "reactivate", cmd_tenants_reactivate, "make a suspended tenant active again")
    reactivate.add_argument("tenant", help=tenant_help)

    keys = groups.add_parser("keys", help="a tenant's API keys", description="a tenant's API keys")
    sub = keys.add_subparsers(dest="admin_keys_command", required=True, metavar="COMMAND", parser_class=parser_class)
    keys_create = admin_command(sub, "create", cmd_keys_create, "issue a key for a tenant (its secret printed once)")
    keys_create.add_argument("--tenant", required=True, help=tenant_help)
    keys_create.add_argument("--name", default="")
    keys_create.add_argument(
        "--scope", action="append", help="e.g. caches:write (repeat, or comma-separate; default: every scope)"
    )
    keys_create.add_argument("--expires-in", type=int, metavar="S", help="seconds until it expires (default: never)")
    keys_ls = admin_command(sub, "ls", cmd_keys_ls, "list a tenant's keys")
    keys_ls.add_argument("--tenant", required=True, help=tenant_help)
    keys_ls.add_argument("--wide", action="store_true", help="full ids, public ids and creation times")
    keys_ls.set_defaults(keys_table=keys_table)
    revoke = admin_command(sub, "revoke", cmd_keys_revoke, "revoke a tenant's key now")
    revoke.add_argument("key", help="the key: its id, id prefix, name or public id")
    revoke.add_argument("--tenant", required=True, help=tenant_help)
