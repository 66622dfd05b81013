"""Every field of an export that a reader reads is covered by verification: changed one at a time, each field of
each record is named by a failure; and the verify summary says what is signed by a digest, what is only chained
(and when the digest that signs it is due), what is witnessed only, and whether the export's own signature held.

The action's name beside its hashed code was read by compliance officers and checked by nothing: an export that
relabels `node.certificate_issued` as `tenant.deleted` verified OK."""

from __future__ import annotations

import copy
import re
import uuid

import pytest

from audit import chain
from audit.actions import AuditAction
from audit.digests import audit_digest_sign
from audit.exports import export_lines, export_plan, write_export
from audit.keys import platform_public_jwk
from audit.services import audit_pseudonymise_tenant

from .helpers import EPOCH, encode, far_future, next_second, read_records, record

pytestmark = pytest.mark.django_db(transaction=True)
TENANT_A, TENANT_B = uuid.uuid4(), uuid.uuid4()


@pytest.fixture(autouse=True)
def one_second_periods(settings):
    settings.KCAAS_AUDIT_DIGEST_SECONDS = 1


@pytest.fixture
def exports(tmp_path):
    """Two exports of one trail: everything (tenant B pseudonymised), and tenant A's (B's events as witnesses);
    digests sign all but the last event."""
    record(TENANT_A, action=AuditAction.NODE_CERTIFICATE_ISSUED)
    record(TENANT_B, new={"n": 1})
    record(TENANT_A, new={"n": 2})
    audit_pseudonymise_tenant(tenant_id=TENANT_B)
    next_second()
    audit_digest_sign()
    record(TENANT_A, new={"n": 3})
    found = {}
    for name, tenant in (("all", None), ("tenant", TENANT_A)):
        path = tmp_path / f"{name}.jsonl"
        write_export(path, start=EPOCH, end=far_future(), tenant_id=tenant)
        found[name] = read_records(path)
    return found


@pytest.fixture
def records(exports):
    return exports["tenant"]


def changed(value):
    """Another value of the same shape."""
    if isinstance(value, bool) or value is None:
        return "tampered"
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return ("0" if value[0] != "0" else "1") + value[1:]
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, dict):
        return {**value, "tampered": True}
    raise AssertionError(f"no change for {value!r}")


def verify(records, fmt="jsonl", **kwargs):
    return chain.verify_export(encode(records, fmt), trusted_key_jwk=platform_public_jwk(), **kwargs)


def fields_of(records):
    """(index, field) of every field of every record but record_type."""
    return [(index, name) for index, r in enumerate(records) for name in r if name != "record_type"]


def test_the_untouched_export_verifies_and_says_what_signs_what(records):
    report = verify(records)
    assert report.ok, [str(p) for p in report.problems]
    assert report.export_signed and report.signed_spans and report.chained_spans and report.witness_spans
    summary = report.summary()
    assert "signed by a digest: seq" in summary and "chained only, not yet signed: seq" in summary
    assert "witnesses only" in summary and "export signature: verified" in summary
    assert re.search(r"signed by the digest of the period ending \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", summary)


def test_pseudonymised_fields_are_said_to_be_covered_by_the_signature_only(exports):
    report = verify(exports["all"])
    assert report.ok and report.export_signed and not report.witness_spans
    assert any("pseudonymised" in note and "export signature covers" in note for note in report.notes)


@pytest.mark.parametrize("which", ["all", "tenant"])
def test_every_field_changed_alone_is_named(exports, which):
    records = exports[which]
    unnamed = []
    for index, name in fields_of(records):
        tampered = copy.deepcopy(records)
        tampered[index][name] = changed(tampered[index][name])
        report = verify(tampered)
        if report.ok:
            unnamed.append(f"{tampered[index]['record_type']}.{name}")
    assert not unnamed, f"changed and still verified: {unnamed}"


def test_a_relabelled_action_is_a_label_mismatch_even_without_the_export_signature(records):
    event = next(r for r in records if r["record_type"] == "event" and r["action"] == 2007)
    event["action_name"] = "tenant.deleted"
    assert ("label_mismatch", event["seq"]) in [(p.code, p.seq) for p in verify(records).problems]
    unsigned = [dict(records[0], version=1)] + records[1:-1]  # a downgrade to an unsigned version 1 export
    report = verify(unsigned)
    assert [p.code for p in report.problems] == ["label_mismatch"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_export_without_its_signature_record_fails(records, fmt):
    assert [p.code for p in verify(records[:-1], fmt).problems] == ["export_unsigned"]
    assert verify(records, fmt).export_signed


def test_a_version_1_export_verifies_and_says_what_is_not_verified(records):
    report = verify([dict(records[0], version=1)] + records[1:-1])
    assert report.ok and not report.export_signed and "export signature: none" in report.summary()
    assert any("version 1" in note for note in report.notes)


def test_the_verifier_names_every_action_as_the_platform_does():
    assert chain.ACTION_NAMES == {action.value: action.code_name for action in AuditAction}


def test_a_trail_without_digests_reads_as_chained_only():
    for n in range(3):
        record(TENANT_A, new={"n": n})
    lines = list(export_lines(export_plan(start=EPOCH, end=far_future()), "jsonl"))
    report = chain.verify_export(lines, trusted_key_jwk=platform_public_jwk())
    assert report.ok and report.signed_spans == [] and report.chained_spans == [(1, 3)]
    assert "signed by a digest: none" in report.summary() and "not yet signed: seq 1-3" in report.summary()
