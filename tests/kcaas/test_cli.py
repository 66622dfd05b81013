"""The `kcaas` command line against the live control plane (real socket, PostgreSQL, Redis, Celery workers): main()
in process with capsys, and the installed entry points (`python -m kcaas`, the `kcaas` script) as subprocesses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcaas.cli import human_bytes, main, parse_bytes
from kcaas.cli_output import when
from tests.caches.conftest import BLOCK_BYTES, SPEC, free_port

pytestmark = pytest.mark.django_db(transaction=True)

SPEC_FLAGS = [
    "--model-fingerprint",
    SPEC["model_fingerprint"],
    "--num-layers",
    str(SPEC["num_layers"]),
    "--num-kv-heads",
    str(SPEC["num_kv_heads"]),
    "--head-dim",
    str(SPEC["head_dim"]),
]  # block size 16 and float16 are the CLI's defaults, as in SPEC


@pytest.fixture
def cli(live_server, capsys):
    """cli(raw_key, *argv) -> (exit code, stdout, stderr) of main() on the live server; asserts the key never shows."""

    def run(raw_key, *argv):
        code = main(["--url", live_server.url, "--api-key", raw_key, *argv])
        out, err = capsys.readouterr()
        secret = raw_key.rsplit("_", 1)[-1]
        assert raw_key not in out + err and secret not in out + err
        return code, out, err

    return run


def test_attach_waits_showing_each_state_then_ls_show_token_detach(make_tenant, node, cli):
    key = make_tenant().raw_key
    code, out, err = cli(key, "attach", "chat", *SPEC_FLAGS, "--device-bytes", "128KiB", "--timeout", "20")
    assert code == 0, err
    assert err.splitlines()[0] == "chat: provisioning" and err.splitlines()[-1] == "chat: ready"  # not a TTY: lines
    shown = dict(line.split(":", 1) for line in out.splitlines())
    cache_id = shown["id"].strip()
    assert shown["state"].strip() == "ready" and shown["endpoint"].strip() == node.endpoint
    assert shown["capacity"].strip() == "device 128 KiB" and shown["block bytes"].strip() == str(BLOCK_BYTES)

    code, out, _ = cli(key, "ls")
    header, row = out.splitlines()
    assert header.split() == ["ID", "NAME", "STATE", "ENDPOINT", "DEVICE"]
    assert row.split() == [cache_id[:8], "chat", "ready", node.endpoint, "128", "KiB"]  # a short id

    code, out, _ = cli(key, "show", cache_id, "--json")
    body = json.loads(out)
    assert code == 0 and body["id"] == cache_id and body["state"] == "ready" and body["spec"] == SPEC
    assert body["capacity"] == {"device": 128 * 1024, "dram": 0, "ssd": 0, "network": 0}

    code, out, err = cli(key, "token", cache_id, "--ttl", "120")
    assert code == 0 and out.strip().count(".") == 2  # a JWT alone on stdout, for $(kcaas token ...)
    assert err.startswith(f"read token for {cache_id} at {node.endpoint}")  # read by default, as everywhere
    for flags, access in ((["--read-only"], "read"), (["--access", "readwrite"], "readwrite")):
        code, out, err = cli(key, "token", cache_id, *flags)
        assert code == 0 and err.startswith(f"{access} token for {cache_id}"), (flags, err)

    code, out, _ = cli(key, "detach", cache_id, "--wait", "--timeout", "20")
    assert code == 0 and out.strip() == f"{cache_id} chat: detached"
    code, out, _ = cli(key, "--json", "ls", "--state", "ready")
    assert code == 0 and json.loads(out) == []


def test_attach_from_a_spec_file_and_the_environment_without_waiting(
    make_tenant, node, live_server, capsys, monkeypatch, tmp_path
):
    handle = make_tenant()
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({**SPEC, "block_size": 32}))
    monkeypatch.setenv("KCAAS_URL", live_server.url)
    monkeypatch.setenv("KCAAS_API_KEY", handle.raw_key)
    code = main(
        [
            "attach",
            "from-file",
            "--spec",
            str(spec_file),
            "--head-dim",
            "16",
            "--device-bytes",
            "1MiB",
            "--dram-bytes",
            "2MiB",
            "--no-wait",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    body = json.loads(out)
    assert code == 0 and err == "" and body["state"] == "provisioning"
    assert body["spec"] == {**SPEC, "block_size": 32, "head_dim": 16}  # flags override the file's fields
    assert body["capacity"] == {"device": 1 << 20, "dram": 2 << 20, "ssd": 0, "network": 0}


def test_on_a_terminal_attach_shows_a_spinner_and_clears_it(make_tenant, node, cli, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = cli(make_tenant().raw_key, "attach", "tty", *SPEC_FLAGS, "--device-bytes", "64KiB")
    assert code == 0 and "state:" in out
    assert err.startswith("\r") and "tty: provisioning" in err and err.endswith("\r\x1b[K")
    assert "\n" not in err  # one rewritten line, not a scroll of them


def test_failed_provisioning_exits_1_with_the_reason_and_how_to_free_the_quota(make_tenant, node, workers, cli):
    workers.fail_reason = "not enough device memory"
    code, out, err = cli(make_tenant().raw_key, "attach", "doomed", *SPEC_FLAGS, "--device-bytes", "64KiB")
    assert code == 1 and out == ""
    error_line, *detail_lines, hint_line = err.splitlines()[-4:]
    assert error_line.startswith("error: cache_failed: Cache ") and error_line.endswith("not enough device memory")
    assert [line.split(":")[0] for line in detail_lines] == ["  cache_id", "  failure_reason"]
    assert hint_line.startswith("hint: detach it to free its quota: kcaas detach ")


def test_keys_create_prints_the_secret_once_and_rotate_revoke_follow(make_tenant, sdk, cli):
    admin = make_tenant(scopes=("caches:write", "keys:write", "usage:read")).raw_key  # a key grants only what it holds
    code, out, err = cli(admin, "keys", "create", "--scope", "caches:read,usage:read", "--name", "ci")
    created = out.strip()
    assert code == 0, err
    assert created.startswith("kc_live_") and "shown this once" in err and created not in err

    code, out, _ = cli(admin, "keys", "ls", "--json")
    listed = {k["name"]: k for k in json.loads(out)}
    assert listed["ci"]["scopes"] == ["caches:read", "usage:read"] and "key" not in listed["ci"]
    ci_id = listed["ci"]["id"]
    code, out, _ = cli(admin, "keys", "ls")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["ID", "NAME", "SCOPES"]
    assert any(line.split()[:2] == [ci_id[:8], "ci"] for line in out.splitlines()[1:])

    assert cli(created, "usage")[0] == 0  # the printed secret is a working key

    code, out, err = cli(admin, "keys", "rotate", ci_id, "--overlap", "60", "--json")
    rotated = json.loads(out)
    assert code == 0 and rotated["key"].startswith("kc_live_") and rotated["rotated_from"] == ci_id
    old = sdk(admin).get_key(ci_id)
    assert err.splitlines()[-1] == f"The old key {ci_id} keeps working until {when(old.expires_at)}, then expires."

    code, out, _ = cli(admin, "keys", "revoke", rotated["id"])
    assert code == 0 and out.startswith(f"{rotated['id']}: revoked since ")
    code, out, err = cli(rotated["key"], "ls")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        "error: api_key_revoked: The API key was revoked.",
        "hint: check KCAAS_API_KEY (or --api-key): the key is missing, unknown, revoked or expired",
    ]


def test_usage_shows_limits_against_use_in_human_bytes(make_tenant, node, sdk, cli):
    handle = make_tenant(max_caches=4, max_device_bytes=1 << 30)
    sdk(handle.raw_key).attach("u1", SPEC, {"device": 256 * BLOCK_BYTES}, wait=False)  # 512 KiB
    code, out, _ = cli(handle.raw_key, "usage")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert code == 0 and rows["RESOURCE"] == ["USED", "LIMIT", "USE"]
    assert rows["caches"] == ["1", "4", "25%"]
    assert rows["device"] == ["512", "KiB", "1", "GiB", "0%"]
    assert rows["rate"] == ["limit:", "100000", "requests/s"]

    code, out, _ = cli(handle.raw_key, "usage", "--json")
    body = json.loads(out)
    assert body["tenant_id"] == str(handle.tenant.pk) and body["used"]["device_bytes"] == 256 * BLOCK_BYTES
    assert body["limits"]["max_caches"] == 4 and set(body["resident"]) == {
        "device_bytes",
        "dram_bytes",
        "ssd_bytes",
        "network_bytes",
    }


def test_attaching_a_taken_name_again_names_the_cache_and_how_to_use_or_free_it(make_tenant, node, cli):
    key = make_tenant().raw_key
    argv = ("attach", "chat", *SPEC_FLAGS, "--device-bytes", "64KiB", "--timeout", "20")
    code, out, err = cli(key, *argv)
    assert code == 0, err
    cache_id = dict(line.split(":", 1) for line in out.splitlines())["id"].strip()
    code, out, err = cli(key, *argv)  # the README's attach, run a second time
    assert code == 1 and out == ""
    assert err.splitlines()[0] == "error: cache_name_taken: A cache with this name is attached."
    hint = err.splitlines()[-1]
    assert hint.startswith(f"hint: a cache named chat already exists (cache_id {cache_id}, state ready): ")
    assert "`kcaas show chat`" in hint and "`kcaas detach chat --wait`" in hint and "another name" in hint


def test_api_errors_exit_1_with_code_message_and_hint(make_tenant, cli):
    code, _, err = cli(make_tenant().raw_key, "show", "00000000-0000-4000-8000-000000000000")
    assert code == 1 and err.splitlines()[0] == "error: not_found: No such cache."
    assert err.splitlines()[1].startswith("hint: `kcaas ls --all` lists every cache")

    code, _, err = cli(make_tenant(scopes=("caches:read",)).raw_key, "keys", "ls")
    assert code == 1 and err.splitlines() == [
        "error: permission_denied: This key lacks the keys:read scope.",
        "  required_scope: keys:read",
        "hint: this key lacks keys:read: use a key that holds it",
    ]

    forged = f"kc_live_{'A' * 12}_{'b' * 40}"
    code, _, err = cli(forged, "ls", "--json")
    error = json.loads(err)["error"]
    assert code == 1 and error["status"] == 401 and error["hint"].startswith("check KCAAS_API_KEY")


def test_usage_errors_exit_2_without_a_traceback(live_server, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("KCAAS_API_KEY", raising=False)
    assert main(["--url", live_server.url, "ls"]) == 2
    assert capsys.readouterr().err == "kcaas: error: no API key: set KCAAS_API_KEY or pass --api-key\n"

    key = f"kc_live_{'A' * 12}_{'s' * 40}"
    assert main(["--api-key", key, "attach", "x", "--device-bytes", "lots"]) == 2
    err = capsys.readouterr().err
    assert "not a byte size: 'lots'" in err and key not in err

    (tmp_path / "bad.json").write_text("{not json")
    assert main(["--api-key", key, "attach", "x", "--spec", str(tmp_path / "bad.json"), "--device-bytes", "1M"]) == 2
    assert "cannot read the spec file" in capsys.readouterr().err
    assert main(["--api-key", key, "attach", "x", "--num-layers", "2", "--device-bytes", "1M"]) == 2
    assert "lacks --model-fingerprint, --num-kv-heads, --head-dim" in capsys.readouterr().err
    assert main(["--api-key", key, "--url", "ftp://example.com", "ls"]) == 2
    assert main(["--help"]) == 0 and "attach" in capsys.readouterr().out


def test_byte_sizes_parse_and_print():
    assert [parse_bytes(v) for v in ("4096", "2KiB", "2k", "1.5GiB", "3MB")] == [4096, 2048, 2048, 3 << 29, 3 * 10**6]
    assert [human_bytes(v) for v in (0, 1023, 1536, 3 << 30)] == ["0 B", "1023 B", "1.5 KiB", "3 GiB"]


# ---- the installed entry points ----------------------------------------------------------------------------------


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCAAS_")}
    return {**env, **extra}


def test_python_m_kcaas_reports_a_closed_port_as_a_connection_error_exit_3(tmp_path):
    port, key = free_port(), f"kc_live_{'A' * 12}_{'s' * 40}"
    done = subprocess.run(
        [sys.executable, "-m", "kcaas", "ls"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(KCAAS_URL=f"http://127.0.0.1:{port}", KCAAS_API_KEY=key),
    )
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.startswith(f"error: connection_error: Could not connect to http://127.0.0.1:{port}")
    assert f"hint: is `make up` running at http://127.0.0.1:{port}?" in done.stderr
    assert "Traceback" not in done.stderr and key not in done.stderr


def test_the_kcaas_console_script_lists_caches_from_the_live_server(make_tenant, node, sdk, live_server, tmp_path):
    script = Path(sys.executable).with_name("kcaas")
    assert script.exists(), "reinstall: pip install -e . creates the kcaas console script ([project.scripts])"
    handle = make_tenant()
    made = sdk(handle.raw_key).attach("scripted", SPEC, {"device": 64 * BLOCK_BYTES}, timeout=20)
    done = subprocess.run(
        [str(script), "ls", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(KCAAS_URL=live_server.url, KCAAS_API_KEY=handle.raw_key),
    )
    assert done.returncode == 0, done.stderr
    assert [(c["id"], c["name"], c["state"]) for c in json.loads(done.stdout)] == [(made.id, "scripted", "ready")]
