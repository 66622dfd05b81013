"""The embedded default's secrets (var/secrets: Django's SECRET_KEY, the key pepper, the KEK, the audit HMAC key)
are created once even when make up's processes all import the settings at the same moment on a first start: every
process reads the same complete secret (a process that read an empty or half-written file, or wrote a second
secret of its own, broke sessions and hashed keys with another pepper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, time
start = float(sys.argv[1])
while time.time() < start:
    pass
from django.conf import settings
print(json.dumps([settings.SECRET_KEY, settings.KCAAS_KEY_PEPPER, settings.KCAAS_KEK, settings.KCAAS_AUDIT_HMAC_KEY]))
"""


def test_processes_starting_together_all_read_the_same_secrets(tmp_path):
    import time

    env = {
        **{k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "KCAAS_KEY_PEPPER", "KCAAS_KEK")},
        "KCAAS_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
    }
    env.pop("KCAAS_AUDIT_HMAC_KEY", None)
    start = time.time() + 3  # every process past its imports, then all read or create at once
    procs = [
        subprocess.Popen([sys.executable, "-c", PROBE, str(start)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    seen = {tuple(json.loads(proc.communicate(timeout=120)[0])) for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(seen) == 1, seen
    (secrets_read,) = seen
    assert all(len(secret) >= 32 for secret in secrets_read)
    for name in ("django-secret-key", "key-pepper", "kek", "audit-hmac"):
        path = tmp_path / "var" / "secrets" / name
        assert path.stat().st_mode & 0o777 == 0o600
    assert not [p for p in (tmp_path / "var" / "secrets").iterdir() if p.name.startswith(".")]  # no temp left
