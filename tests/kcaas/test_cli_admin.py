"""`kcaas admin ...` and kcaas.admin() against the live control plane (pytest-django's live_server: the WSGI app on a
real socket, PostgreSQL, Redis): an operator onboards a tenant (create with a quota, change it, issue a key that then
works), and every bad input ends in one clear error and the CLI's usual exit code. The operator authenticates as
`make up`'s does: HTTP basic with KCAAS_ADMIN_USER / KCAAS_ADMIN_PASSWORD."""

import importlib.util
import json
import types
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

import kcaas
from kcaas import errors
from kcaas.cli import main
from kcaas.client_admin import AdminClient, Tenant

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_USER, ADMIN_PASSWORD = "ops-admin", "pw-ops-admin-1234"
FAST_HASHER = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # Basic auth hashes on every request; tests only


@pytest.fixture
def operator(live_server, settings, monkeypatch, redis_client):
    """A platform administrator (staff, no console role) and the operator's shell: KCAAS_URL, KCAAS_ADMIN_USER and
    KCAAS_ADMIN_PASSWORD exported, as the banner's `operator shell:` line does. Redis starts empty (the password
    door's failure counters)."""
    settings.PASSWORD_HASHERS = FAST_HASHER
    get_user_model().objects.create_user(ADMIN_USER, password=ADMIN_PASSWORD, is_staff=True)
    for name, value in (("KCAAS_URL", live_server.url), ("KCAAS_ADMIN_USER", ADMIN_USER)):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KCAAS_ADMIN_PASSWORD", ADMIN_PASSWORD)
    monkeypatch.delenv("KCAAS_API_KEY", raising=False)
    return live_server.url


@pytest.fixture
def admin_cli(operator, capsys):
    """admin_cli(*argv) -> (exit code, stdout, stderr) of `kcaas admin *argv`; the password never shows."""

    def run(*argv):
        code = main(["admin", *argv])
        out, err = capsys.readouterr()
        assert ADMIN_PASSWORD not in out + err
        return code, out, err

    return run


def _quota_rows(out: str) -> dict[str, list[str]]:
    """`tenants show`'s quota table: flag -> the rest of its row (value, source)."""
    rows = out.split("\nquota:\n", 1)[1].splitlines()[1:]
    return {row.split()[0]: row.split()[1:] for row in rows}


def _key_from(out: str) -> str:
    key, export = out.splitlines()
    assert key.startswith("kc_live_")
    return key


def test_onboarding_create_quota_key_and_the_key_works(admin_cli, operator, capsys):
    code, out, err = admin_cli("tenants", "create", "acme", "--device-bytes", "8GiB", "--caches", "3")
    assert code == 0, err
    assert "name:    acme" in out and "status:  active" in out
    quota = _quota_rows(out)
    assert quota["device-bytes"] == ["8", "GiB", "set"] and quota["caches"] == ["3", "set"]
    assert quota["dram-bytes"][-1] == "default"

    code, out, err = admin_cli("tenants", "quota", "acme", "--device-bytes", "16GiB", "--caches", "default")
    assert code == 0, err
    quota = _quota_rows(out)
    assert quota["device-bytes"] == ["16", "GiB", "set"] and quota["caches"][-1] == "default"

    code, out, err = admin_cli("tenants", "ls")
    assert code == 0 and any(line.split()[1:3] == ["acme", "active"] for line in out.splitlines()[1:])
    tenant_id = next(line.split()[0] for line in out.splitlines() if " acme " in line)

    code, out, err = admin_cli("keys", "create", "--tenant", tenant_id, "--name", "onboarding")
    assert code == 0, err
    key = _key_from(out)
    assert out.splitlines()[1] == f"export KCAAS_URL={operator} KCAAS_API_KEY={key}"
    assert "shown this once" in err and key not in err

    # the tenant's shell: the key works, and sees the quota the operator set
    assert main(["--api-key", key, "usage", "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert usage["tenant_id"] == tenant_id and usage["limits"]["max_device_bytes"] == 16 << 30
    with kcaas.Client(operator, key) as client:
        assert client.whoami().tenant_id == tenant_id

    code, out, _ = admin_cli("keys", "ls", "--tenant", "acme")
    assert code == 0 and "onboarding" in out and "active" in out
    code, out, err = admin_cli("keys", "revoke", "onboarding", "--tenant", "acme")
    assert code == 0 and ": revoked since " in out, err
    assert main(["--api-key", key, "usage"]) == 1
    assert "error: api_key_revoked" in capsys.readouterr().err


def test_json_output_suspend_and_reactivate(admin_cli, operator, capsys):
    code, out, _ = admin_cli("tenants", "create", "globex", "--dram-bytes", "512MiB", "--json")
    created = json.loads(out)
    assert code == 0 and created["name"] == "globex" and created["status"] == "active"
    assert created["quota"]["limits"]["max_dram_bytes"] == 512 << 20
    assert (
        created["quota"]["overrides"]["max_dram_bytes"] == 512 << 20
        and created["quota"]["overrides"]["max_caches"] is None
    )

    code, out, _ = admin_cli("keys", "create", "--tenant", "globex", "--scope", "usage:read", "--json")
    issued = json.loads(out)
    assert code == 0 and issued["scopes"] == ["usage:read"] and issued["tenant_id"] == created["id"]

    code, out, _ = admin_cli("tenants", "suspend", created["id"])
    assert code == 0 and "suspended" in out
    assert main(["--api-key", issued["key"], "usage"]) == 1
    assert capsys.readouterr().err.startswith("error: tenant_inactive: ")
    code, out, _ = admin_cli("tenants", "reactivate", "globex", "--json")
    assert code == 0 and json.loads(out)["status"] == "active"
    assert main(["--api-key", issued["key"], "usage"]) == 0
    capsys.readouterr()

    code, out, _ = admin_cli("tenants", "show", "globex", "--json")
    assert code == 0 and json.loads(out)["id"] == created["id"]


def test_bad_input_ends_in_one_clear_error_and_the_usual_exit_code(admin_cli):
    assert admin_cli("tenants", "create", "initech")[0] == 0

    code, _, err = admin_cli("tenants", "create", "initech")
    lines = err.splitlines()
    assert code == 1 and lines[0].startswith("error: tenant_name_taken: "), err
    assert lines[-1] == "hint: pick another name, or look at the existing tenant: kcaas admin tenants show NAME"

    code, _, err = admin_cli("tenants", "create", "hooli", "--device-bytes", "lots")
    assert code == 2 and "not a byte size: 'lots'" in err and "Traceback" not in err

    code, _, err = admin_cli("tenants", "quota", "initech", "--requests-per-second", "0")
    assert code == 1 and err.startswith("error: validation_error: ") and "max_requests_per_second" in err

    for argv in (("tenants", "show", "nobody"), ("keys", "create", "--tenant", "nobody")):
        code, _, err = admin_cli(*argv)
        assert code == 1 and err.splitlines()[0] == "error: not_found: No tenant is named 'nobody' or has that id.", err
        assert err.splitlines()[-1].startswith("hint: `kcaas admin tenants ls` lists the tenants")

    code, _, err = admin_cli("keys", "revoke", "no-such-key", "--tenant", "initech")
    assert code == 1 and err.startswith("error: not_found: ") and "kcaas admin keys ls --tenant" in err


def test_another_tenants_key_is_not_revoked_under_a_tenant(admin_cli):
    admin_cli("tenants", "create", "first")
    admin_cli("tenants", "create", "second")
    code, out, _ = admin_cli("keys", "create", "--tenant", "first", "--json")
    key_id = json.loads(out)["id"]
    code, _, err = admin_cli("keys", "revoke", key_id, "--tenant", "second")
    assert code == 1 and err.startswith("error: not_found: ")
    code, out, _ = admin_cli("keys", "ls", "--tenant", "first", "--json")
    assert [k["state"] for k in json.loads(out)] == ["active"]


def test_a_wrong_password_is_the_apis_code_and_exit_1(admin_cli, monkeypatch):
    monkeypatch.setenv("KCAAS_ADMIN_PASSWORD", "not-the-password")
    code, out, err = admin_cli("tenants", "ls")
    lines = err.splitlines()
    assert code == 1 and out == "" and lines[0] == "error: authentication_failed: Invalid username/password."
    assert lines[-1].startswith("hint: the admin credentials were refused: set KCAAS_ADMIN_PASSWORD")
    assert "not-the-password" not in err
    code, _, err = admin_cli("tenants", "ls", "--json")
    error = json.loads(err)["error"]
    assert code == 1 and error["code"] == "authentication_failed" and error["status"] == 401
    assert "KCAAS_ADMIN_PASSWORD" in error["hint"]


def test_no_password_is_a_usage_error_naming_the_variable_and_make_up(admin_cli, monkeypatch):
    monkeypatch.delenv("KCAAS_ADMIN_PASSWORD")
    code, out, err = admin_cli("tenants", "ls")
    assert code == 2 and out == ""
    assert err.startswith("kcaas: error: no admin password: set KCAAS_ADMIN_PASSWORD")
    assert "`make up` prints it" in err and "var/secrets/admin-password" in err


def test_the_sdk_reads_the_environment_and_types_its_answers(operator):
    with kcaas.admin() as admin:
        assert isinstance(admin, AdminClient) and ADMIN_PASSWORD not in repr(admin)
        tenant = admin.create_tenant("umbrella", max_ssd_bytes="1GiB")
        assert isinstance(tenant, Tenant) and tenant.quota.limits["max_ssd_bytes"] == 1 << 30
        assert admin.get_tenant(tenant.id) == admin.get_tenant("umbrella")
        assert admin.set_quota("umbrella", max_ssd_bytes=None).overrides["max_ssd_bytes"] is None
        issued = admin.create_key("umbrella", ["caches:read"], name="sdk")
        assert issued.key.startswith("kc_live_") and [k.id for k in admin.list_keys(tenant.id)] == [issued.id]
        assert admin.revoke_key("umbrella", issued.id).state == "revoked"
        assert admin.suspend("umbrella").status == "suspended" and admin.reactivate(tenant.id).status == "active"
        with pytest.raises(errors.ConflictError) as taken:
            admin.create_tenant("umbrella")
        assert taken.value.code == "tenant_name_taken" and "kcaas admin tenants show" in taken.value.hint
        with pytest.raises(errors.NotFoundError):
            admin.get_tenant("nobody")
    with pytest.raises(errors.AuthenticationError) as refused:
        kcaas.admin(password="wrong-password").list_tenants()
    assert "KCAAS_ADMIN_PASSWORD" in refused.value.hint and "wrong-password" not in str(refused.value)


def test_the_sdk_without_a_password_says_where_to_find_it(monkeypatch):
    monkeypatch.delenv("KCAAS_ADMIN_PASSWORD", raising=False)
    with pytest.raises(errors.KcaasError) as missing:
        kcaas.admin("http://127.0.0.1:8000")
    assert missing.value.code == "not_authenticated" and "var/secrets/admin-password" in missing.value.hint


def test_make_ups_banner_has_the_operator_shell_line():
    spec = importlib.util.spec_from_file_location("kcaas_up", Path(__file__).resolve().parents[2] / "scripts" / "up.py")
    up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(up)
    boot = {"api_key": "kc_live_x_y", "password": "s3cret", "console_password": "c", "tls": {"ca": "/ca.pem"}}
    node = {
        "KCAAS_NODE_ENDPOINT": "127.0.0.1:8001",
        "KCAAS_NODE_METRICS_PORT": "9100",
        "KCAAS_NODE_MIGRATION_LISTEN": "127.0.0.1:0",
        "KCAAS_NODE_SSD_DIR": "/ssd",
    }
    text = up.banner("http://127.0.0.1:8000", boot, [node], {"web": types.SimpleNamespace(pid=1)})
    lines = [line.strip() for line in text.splitlines()]
    assert (
        "operator shell: export KCAAS_URL=http://127.0.0.1:8000 KCAAS_ADMIN_USER=admin KCAAS_ADMIN_PASSWORD=s3cret"
        in lines
    )
    assert [line for line in lines if line.startswith("export ")] == [
        "export KCAAS_URL=http://127.0.0.1:8000 KCAAS_API_KEY=kc_live_x_y"
    ]  # the README session test pastes the one line that starts with export


@pytest.mark.parametrize(
    "argv",
    [
        ["admin"],
        ["admin", "tenants"],
        ["admin", "tenants", "create"],
        ["admin", "tenants", "quota"],
        ["admin", "keys", "create"],
        ["admin", "keys", "revoke"],
    ],
)
def test_admin_help_fits_100_columns_and_names_the_environment(argv, capsys):
    assert main([*argv, "--help"]) == 0
    text = capsys.readouterr().out
    assert all(len(line) <= 100 for line in text.splitlines())
    if argv != ["admin", "tenants"]:
        assert "KCAAS_ADMIN_PASSWORD" in text
