"""Under `make up` the var/ directory holds the SQLite database (TOTP devices, sessions), the file broker's messages
(which carry provisioning orders), the dev PKI and the secrets: every file there is 0600 and every directory 0700.

The functions that make those files are checked under a permissive umask (so an explicit mode, not the caller's
umask, is what keeps them private); `secure_var_dir` tightens a var/ an older run left 0755/0644; the real
scripts/up.py run (test_make_up.py's flow, shortened) leaves nothing readable by others."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import stat
from pathlib import Path

from kombu import Connection

import kcaas
from devtools import dev_pki
from kcaas.node_protocol import broker as fs_broker
from tests.e2e.test_make_up import SPEC
from tests.e2e.up_support import REPO, assert_session_gone, kill_session, read_banner, start_up
from tests.faults import free_port


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def up_module():
    spec = importlib.util.spec_from_file_location("kcaas_up_script_modes", REPO / "scripts" / "up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loose(root: Path) -> list[str]:
    """Every path under root (root included) readable, writable or searchable by group or others."""
    found = [] if mode(root) & 0o077 == 0 else [f"{root} {oct(mode(root))}"]
    for path in root.rglob("*"):
        try:
            if not path.is_symlink() and mode(path) & 0o077:
                found.append(f"{path} {oct(mode(path))}")
        except FileNotFoundError:  # a broker message consumed while we looked
            pass
    return found


def test_dev_pki_files_are_owner_only_whatever_the_umask(tmp_path):
    with umask(0):
        paths = dev_pki.write_dev_pki(tmp_path / "pki")
        ca_key, ca_cert = dev_pki.new_ca("t", valid_for=__import__("datetime").timedelta(hours=1))
        paths.update(
            {f"node_{k}": v for k, v in dev_pki.write_node_pki(tmp_path / "nodes", ca_key, ca_cert, "n1").items()}
        )
        stale = tmp_path / "stale.pem"
        stale.write_bytes(b"old")
        os.chmod(stale, 0o644)
        dev_pki.write_private(stale, b"new")  # an existing file is made 0600 before it is rewritten
    for path in paths.values():
        assert mode(Path(path)) == 0o600, path
    assert mode(tmp_path / "pki") == 0o700 and mode(tmp_path / "nodes") == 0o700
    assert mode(stale) == 0o600 and stale.read_bytes() == b"new"


def test_file_broker_messages_and_folders_are_owner_only_whatever_the_umask(tmp_path):
    options = fs_broker.folder_options(tmp_path / "celery")
    with umask(0), Connection(fs_broker.URL, transport_options=options) as connection:
        queue = connection.SimpleQueue("node.x")
        queue.put({"hash_key_box": "kcs1.x"})
        queued = [p for p in Path(options["data_folder_in"]).iterdir() if p.name.endswith(".msg")]
        assert queued and all(mode(p) == 0o600 for p in queued)
        for folder in ("data_folder_in", "control_folder"):
            assert mode(Path(options[folder])) == 0o700, folder
        assert all(mode(p) == 0o600 for p in Path(options["control_folder"]).iterdir())  # exchange tables
        queue.get(timeout=5).ack()
        queue.close()


def test_secure_var_dir_tightens_what_an_older_run_left(tmp_path):
    var = tmp_path / "var"
    (var / "celery" / "queue").mkdir(parents=True)
    (var / "kcaas.sqlite3").write_bytes(b"db")
    (var / "celery" / "queue" / "1.node.x.msg").write_bytes(b"{}")
    for path in (var, var / "celery", var / "celery" / "queue"):
        os.chmod(path, 0o755)
    for path in (var / "kcaas.sqlite3", var / "celery" / "queue" / "1.node.x.msg"):
        os.chmod(path, 0o644)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not ours")
    os.chmod(outside, 0o644)
    (var / "link").symlink_to(outside)
    up_module().secure_var_dir(var)
    assert loose(var) == []
    assert mode(outside) == 0o644  # a link is never followed


def test_make_up_leaves_nothing_under_var_readable_by_others(tmp_path):
    var = tmp_path / "var"
    var.mkdir(mode=0o755)
    (var / "left-by-an-older-run").write_bytes(b"x")
    os.chmod(var / "left-by-an-older-run", 0o644)
    port = free_port()
    up = start_up(tmp_path, port)
    try:
        banner = read_banner(up, "make up")
        api_key = re.search(r"demo API key\s+(kc_live_\S+)", banner).group(1)
        client = kcaas.Client(f"http://127.0.0.1:{port}", api_key)
        cache = client.attach("modes", SPEC, {"device": 1 << 20}, timeout=60)  # messages through the file broker
        assert cache.state == "ready"
        client.close()
        assert (var / "kcaas.sqlite3").is_file() and (var / "secrets" / "dev-ca.pem").is_file()
        assert loose(var) == []
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        kill_session(up)
    assert_session_gone(up)
    assert loose(var) == []
