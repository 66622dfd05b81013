"""Exports (JSONL and CSV) verify offline; every kind of tampering is found and named by seq; a superuser who
bypasses the append-only trigger is caught by the next export; the stand-alone verifier needs no Django."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from audit import chain
from audit.digests import audit_digest_sign
from audit.exports import write_export
from audit.keys import b64url, platform_public_jwk, public_jwk_of

from .helpers import EPOCH, encode, far_future, first_problem, next_second, read_records, record

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]
FORMATS = ["jsonl", "csv"]
PROBE = """
import runpy, sys
script, export = sys.argv[1], sys.argv[2]
sys.argv = [script, "verify", export]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
loaded = [m for m in sys.modules if m.split(".")[0] in ("django", "rest_framework", "audit", "controlplane")]
assert not loaded, loaded
"""
TENANT_A, TENANT_B = uuid.uuid4(), uuid.uuid4()


@pytest.fixture(autouse=True)
def one_second_periods(settings):
    settings.KCAAS_AUDIT_DIGEST_SECONDS = 1


@pytest.fixture
def trail():
    """Six events of two tenants (seq 1-6), signed by digests, then seq 7 not yet signed."""
    for n in range(6):
        record(TENANT_A if n % 2 == 0 else TENANT_B, new={"n": n, "note": 'line\nbreak, "quoted" ü'})
    next_second()
    audit_digest_sign()
    record(TENANT_A)


def export(tmp_path, fmt="jsonl", tenant_id=None) -> Path:
    path = tmp_path / f"export.{fmt}"
    write_export(path, start=EPOCH, end=far_future(), tenant_id=tenant_id, fmt=fmt)
    return path


def verify(records, fmt, **kwargs):
    return chain.verify_export(encode(records, fmt), **kwargs)


def events_of(records):
    return [r for r in records if r["record_type"] == "event"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_export_round_trips_and_verifies(trail, tmp_path, fmt):
    path = export(tmp_path, fmt)
    report = chain.verify_export(path, trusted_key_jwk=platform_public_jwk())
    assert report.ok, [str(p) for p in report.problems]
    assert (report.events, report.witnesses, report.first_seq, report.last_seq) == (7, 0, 1, 7)
    assert report.digests >= 1 and report.chained_spans and report.chained_spans[-1][1] == 7  # the tail: unsigned
    assert "not yet signed" in report.summary() and report.export_signed
    assert chain.verify_export(encode(read_records(export(tmp_path)), fmt)).ok  # re-encoding is lossless


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tenant_export_holds_only_its_events_and_witnesses_for_the_rest(trail, tmp_path, fmt):
    records = read_records(export(tmp_path, "jsonl", tenant_id=TENANT_A))
    header = records[0]
    assert header["filter"] == {"tenant_id": str(TENANT_A)} and header["platform_key"] == platform_public_jwk()
    assert {r["tenant_id"] for r in events_of(records)} == {str(TENANT_A)}
    witnesses = [r for r in records if r["record_type"] == "witness"]
    assert [w["seq"] for w in witnesses] == [2, 4, 6] and all(
        set(w) == {"record_type", "seq", "prev_hash", "hash"} for w in witnesses
    )
    assert str(TENANT_B) not in "".join(encode(records, "jsonl"))
    assert verify(records, fmt).ok
    assert chain.verify_export(export(tmp_path, fmt, tenant_id=TENANT_A)).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_changed_field_is_named(trail, tmp_path, fmt):
    records = read_records(export(tmp_path))
    records[3]["action"] = 1001  # seq 3, a hashed field
    assert first_problem(verify(records, fmt)) == ("hash_mismatch", 3)
    records = read_records(export(tmp_path))
    records[2]["new_values"] = {"n": 99}  # seq 2, a personal field while its salt is there
    report = verify(records, fmt)
    assert first_problem(report) == ("commitment_mismatch", 2) and "new_values" in report.problems[0].message


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_deleted_line_is_named(trail, tmp_path, fmt):
    records = read_records(export(tmp_path))
    del records[4]  # seq 4
    report = verify(records, fmt)
    assert first_problem(report) == ("deleted", 5) and "seq 4 missing" in report.problems[0].message


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_inserted_line_is_named(trail, tmp_path, fmt):
    records = read_records(export(tmp_path))
    forged = dict(records[2], target_id="forged")  # a second seq 2
    records.insert(3, forged)
    assert ("inserted", 2) in [(p.code, p.seq) for p in verify(records, fmt).problems]
    records = read_records(export(tmp_path))
    last = events_of(records)[-1]  # a new event appended after seq 7, correctly hashed: the header disagrees
    appended = dict(last, seq=8, prev_hash=last["hash"])
    appended["hash"] = chain.event_hash(appended["prev_hash"], appended, appended["commitments"])
    records.insert(8, appended)
    assert first_problem(verify(records, fmt))[0] == "header_mismatch"


@pytest.mark.parametrize("fmt", FORMATS)
def test_swapped_lines_are_named(trail, tmp_path, fmt):
    records = read_records(export(tmp_path))
    records[2], records[3] = records[3], records[2]  # seq 2 and 3
    problems = [(p.code, p.seq) for p in verify(records, fmt).problems]
    assert problems == [("reordered", 2), ("export_signature_mismatch", None)]  # the chain names it, the signature too


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_changed_digest_is_named(trail, tmp_path, fmt):
    records = read_records(export(tmp_path))
    digest = next(r for r in records if r["record_type"] == "digest")
    digest["head_hash"] = "ab" * 32
    codes = {p.code for p in verify(records, fmt).problems}
    assert {"digest_hash_mismatch", "digest_signature_invalid", "digest_head_mismatch"} <= codes


def test_a_validly_signed_digest_whose_head_is_not_the_chain_is_named(trail, tmp_path):
    from audit.keys import platform_sign

    records = read_records(export(tmp_path))
    digest = next(r for r in records if r["record_type"] == "digest" and r["head_seq"] == 6)
    body = chain.digest_body(
        **{k: digest[k] for k in ("period_start", "period_end", "head_seq", "prev_digest_hash", "key_id")},
        head_hash="cd" * 32,
    )
    digest.update(
        head_hash="cd" * 32, digest_hash=chain.digest_hash(body), signature=platform_sign(chain.canonical(body))[1]
    )
    problems = [(p.code, p.seq) for p in verify(records, "jsonl").problems]
    assert ("digest_head_mismatch", 6) in problems and "digest_signature_invalid" not in dict(problems)


@pytest.mark.parametrize("fmt", FORMATS)
def test_digests_signed_with_another_key_are_named(trail, tmp_path, fmt):
    other = Ed25519PrivateKey.generate()
    records = read_records(export(tmp_path))
    for digest in (r for r in records if r["record_type"] == "digest"):  # re-signed by a forger
        digest["signature"] = b64url(
            other.sign(
                chain.canonical(
                    chain.digest_body(
                        **{
                            k: digest[k]
                            for k in (
                                "period_start",
                                "period_end",
                                "head_seq",
                                "head_hash",
                                "prev_digest_hash",
                                "key_id",
                            )
                        }
                    )
                )
            )
        )
    assert first_problem(verify(records, fmt))[0] == "digest_signature_invalid"
    records[0]["platform_key"] = public_jwk_of(other.public_key())  # ...who also swaps in their public key
    report = verify(records, fmt, trusted_key_jwk=platform_public_jwk())
    assert first_problem(report)[0] == "untrusted_key"
    assert "digest_signature_invalid" in {p.code for p in report.problems}


def test_a_superuser_edit_behind_the_trigger_is_caught_by_the_next_export(trail, tmp_path):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")  # triggers off (superuser only)
        cursor.execute("UPDATE audit_auditevent SET target_type = 'nothing' WHERE seq = 4")
        cursor.execute("UPDATE audit_auditevent SET old_values = '{\"n\": 1}' WHERE seq = 5")
    report = chain.verify_export(export(tmp_path, "csv"))
    assert [(p.code, p.seq) for p in report.problems] == [("hash_mismatch", 4), ("commitment_mismatch", 5)]


def test_the_management_command_pins_the_platform_key(trail, tmp_path, capsys):
    path = export(tmp_path)
    call_command("audit_verify", str(path))
    assert capsys.readouterr().out.startswith("OK: 7 events")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3] + lines[4:]))  # seq 3 deleted
    with pytest.raises(CommandError):
        call_command("audit_verify", str(path))
    assert "seq 4: deleted: seq 3 missing" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stand_alone_verifier_needs_no_django(trail, tmp_path, fmt):
    path = export(tmp_path, fmt)
    key = tmp_path / "platform-key.json"
    key.write_text(chain.canonical(platform_public_jwk()).decode())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}  # no DJANGO_SETTINGS_MODULE
    command = [sys.executable, str(REPO / "audit" / "chain.py"), "verify", str(path), "--key", str(key)]
    good = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert good.returncode == 0 and good.stdout.startswith("OK: "), good.stdout + good.stderr
    isolated = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO / "audit" / "chain.py"), str(path)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert isolated.returncode == 0, isolated.stderr  # ran the verifier without importing Django or the app
    path.write_text(path.read_text().replace("max_caches", "max_cachez", 1))
    bad = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert bad.returncode == 1 and bad.stdout.startswith("FAILED: ") and "commitment_mismatch" in bad.stdout


def test_an_export_of_an_empty_range_verifies(trail, tmp_path):
    path = tmp_path / "empty.jsonl"
    write_export(path, start=far_future(), end=far_future().replace(year=far_future().year + 1))
    report = chain.verify_export(path)
    assert report.ok and (report.events, report.witnesses, report.first_seq) == (0, 0, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_damaged_export_is_reported_never_a_crash(trail, tmp_path, fmt):
    import random

    text = export(tmp_path, fmt).read_text()
    rng = random.Random(5)
    for _ in range(300):
        at = rng.randrange(len(text))
        damaged = text[:at] + rng.choice(['"', "{", "}", "1", "x", "", ",", "\\", "\n", "null"]) + text[at + 1 :]
        report = chain.verify_export(damaged.splitlines(keepends=True))  # must not raise
        assert report.ok or report.problems[0].code
    for garbage in ("", "{}", "[1]\n", "record_type\nheader\n", '{"record_type":"header","range":[1]}\n'):
        assert not chain.verify_export([garbage]).ok
