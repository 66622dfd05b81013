"""The `kcaas` command line on the live control plane, as a new user meets it: caches and keys named by name or id
prefix (unknown and ambiguous names are clear errors), `ls` without the detached caches unless --all, the server's
TTL clamp reported, validation errors with their details, and every table within 100 columns."""

import json
import re

import pytest

from tests.caches.conftest import BLOCK_BYTES, SPEC
from tests.kcaas.test_cli import cli  # noqa: F401 - the fixture: main() on the live server

pytestmark = pytest.mark.django_db(transaction=True)

ALL_SCOPES = ("caches:read", "caches:write", "keys:read", "keys:write", "usage:read")
LONG_NAME = "a-cache-name-long-enough-to-push-the-table-past-one-hundred-col"  # 63 characters, the most allowed


def _lines_fit(text: str) -> bool:
    return all(len(line) <= 100 for line in text.splitlines())


def test_caches_by_name_and_prefix_ttl_clamp_and_detached_hidden_from_ls(make_tenant, node, sdk, cli):
    key = make_tenant().raw_key
    first = sdk(key).attach("alpha", SPEC, {"device": 64 * BLOCK_BYTES}, timeout=20)

    for reference in ("alpha", first.id[:8], first.id):
        code, out, err = cli(key, "show", reference, "--json")
        assert code == 0 and json.loads(out)["id"] == first.id, err

    code, out, err = cli(key, "token", "alpha", "--ttl", "99999999")
    assert code == 0 and out.strip().count(".") == 2
    assert (
        err.splitlines()[0]
        == "kcaas: note: the server clamped --ttl 99999999 to 900 s (its range: 60 s to its maximum)"
    )
    code, out, err = cli(key, "token", first.id[:8], "--ttl", "120")
    assert code == 0 and "clamped" not in err

    code, out, _ = cli(key, "detach", "alpha", "--wait", "--timeout", "20")
    assert code == 0 and out.strip() == f"{first.id} alpha: detached"
    code, out, err = cli(key, "ls")
    assert code == 0 and out.splitlines() == ["ID  NAME  STATE  ENDPOINT  DEVICE"]
    assert err == "kcaas: 1 detached cache not shown: `kcaas ls --all` lists them\n"
    code, out, err = cli(key, "ls", "--all")
    assert code == 0 and err == "" and out.splitlines()[1].split()[:3] == [first.id[:8], "alpha", "detached"]
    code, out, err = cli(key, "ls", "--json")
    assert code == 0 and err == "" and json.loads(out) == []
    code, out, err = cli(key, "ls", "--all", "--json")
    assert code == 0 and [(c["id"], c["state"]) for c in json.loads(out)] == [(first.id, "detached")]

    second = sdk(key).attach("alpha", SPEC, {"device": 64 * BLOCK_BYTES}, timeout=20)
    code, out, _ = cli(key, "show", "alpha", "--json")  # the attached one before the detached one
    assert code == 0 and json.loads(out)["id"] == second.id
    assert cli(key, "detach", "alpha", "--wait", "--timeout", "20")[0] == 0
    code, out, err = cli(key, "show", "alpha")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == "error: ambiguous: 2 caches match 'alpha'." and len(lines) == 4
    assert sorted(lines[1:3]) == sorted(f"  matches: {c.id} alpha (detached)" for c in (first, second))
    assert lines[3] == "hint: name it by id, or by an id prefix long enough to be unique"


def test_unknown_names_and_refused_values_print_code_message_details_and_hint(make_tenant, node, sdk, cli):
    key = make_tenant().raw_key
    sdk(key).attach("beta", SPEC, {"device": 64 * BLOCK_BYTES}, timeout=20)

    code, out, err = cli(key, "show", "nosuch")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        "error: not_found: No cache is named 'nosuch' or has an id starting with it.",
        "  cache: nosuch",
        "hint: `kcaas ls --all` lists every cache, `kcaas keys ls` the keys; names and id prefixes are accepted",
    ]

    code, out, err = cli(key, "token", "beta", "--ttl", "0")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        "error: validation_error: The request is invalid.",
        "  ttl_seconds: Ensure this value is greater than or equal to 1.",
        "hint: fix what the details name and run it again; `kcaas COMMAND --help` lists the options",
    ]
    code, _, err = cli(key, "token", "beta", "--ttl", "0", "--json")
    error = json.loads(err)["error"]
    assert code == 1 and error["code"] == "validation_error" and error["status"] == 400
    assert error["details"] == {"fields": {"ttl_seconds": ["Ensure this value is greater than or equal to 1."]}}
    assert error["hint"].startswith("fix what the details name")

    forged = f"kc_live_{'A' * 12}_{'b' * 40}"
    code, _, err = cli(forged, "show", "beta")
    lines = err.splitlines()
    assert code == 1 and lines[0].startswith("error: ") and lines[-1].startswith("hint: check KCAAS_API_KEY")


def test_keys_by_name_ambiguous_names_and_tables_within_100_columns(make_tenant, node, sdk, cli):
    admin = make_tenant(scopes=ALL_SCOPES).raw_key
    long_key_name = "k" * 100
    made = [sdk(admin).create_key(list(ALL_SCOPES), name=name) for name in ("ci", "ci", long_key_name)]
    sdk(admin).attach(LONG_NAME, SPEC, {"device": 64 * BLOCK_BYTES}, timeout=20)

    code, out, err = cli(admin, "keys", "revoke", "ci")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0] == "error: ambiguous: 2 keys match 'ci'."
    assert sorted(lines[1:3]) == sorted(f"  matches: {k.id} ci (active)" for k in made[:2])
    assert lines[3].startswith("hint: name it by id")

    code, out, _ = cli(admin, "keys", "revoke", made[0].id[:8])
    assert code == 0 and out.startswith(f"{made[0].id}: revoked since ")
    code, out, _ = cli(admin, "keys", "revoke", "ci")  # the one active "ci" left
    assert code == 0 and out.startswith(f"{made[1].id}: revoked since ")

    for argv in (("keys", "ls"), ("ls",), ("usage",)):
        code, out, err = cli(admin, *argv)
        assert code == 0 and _lines_fit(out), f"{argv}: {out}"
    code, out, _ = cli(admin, "keys", "ls")
    long_row = next(line for line in out.splitlines() if line.startswith(made[2].id[:8]))
    assert "kkkk..." in long_row and long_key_name not in long_row
    code, out, _ = cli(admin, "ls")
    assert "a-cache-name-long-enough" in out and LONG_NAME not in out

    code, out, _ = cli(admin, "keys", "ls", "--wide")
    assert code == 0 and made[2].id in out and long_key_name in out and not _lines_fit(out)
    code, out, _ = cli(admin, "ls", "--wide")
    assert (
        code == 0
        and LONG_NAME in out
        and out.splitlines()[0].split()[-4:]
        == [
            "DRAM",
            "SSD",
            "NETWORK",
            "CREATED",
        ]
    )


def test_no_capacity_shows_what_was_asked_what_is_free_and_the_servers_hint(make_tenant, node, cli):
    flags = ["--model-fingerprint", SPEC["model_fingerprint"], "--num-layers", str(SPEC["num_layers"])]
    flags += ["--num-kv-heads", str(SPEC["num_kv_heads"]), "--head-dim", str(SPEC["head_dim"])]
    code, out, err = cli(
        make_tenant(max_device_bytes=1 << 41).raw_key, "attach", "huge", *flags, "--device-bytes", "1TiB", "--no-wait"
    )
    lines = err.splitlines()
    assert code == 1 and out == "" and lines[0].startswith("error: no_capacity: No node has the requested capacity")
    assert f"  requested.device: {1 << 40} (1 TiB)" in lines and "  largest_free.device: " in err
    assert re.search(r"  largest_free\.device: \d+ \(\d+(\.\d)? [KMGT]?i?B\)", err)  # exact bytes and a size
    assert "device 1 TiB asked" in lines[0]  # the message a person reads, in units
    assert lines[-1] == "hint: Node agents size their tiers from KCAAS_NODE_DEVICE_BYTES (bytes)."
    assert not any(line.startswith("  hint") for line in lines)
