"""The audit trail's hash chain, in one file that needs only the standard library (and `cryptography` for digest
signatures), so a compliance team can verify an export with this file alone.

An event is hashed over a canonical encoding of its non-personal fields plus *commitments* to its personal ones:

    commitment(f) = sha256(salt || f || 0x00 || canonical(value of f))            (hex; salt: 16 random bytes)
    hash          = sha256(prev_hash (32 raw bytes) || canonical({NON_PERSONAL fields..., "commitments": {...}}))

so pseudonymising an erased tenant (replacing its personal fields and wiping the salt) leaves every hash, and so the
chain, intact: the commitments still bind what was there, and without the salt they reveal nothing of it.
canonical(x) = JSON with sorted keys, no whitespace, UTF-8, integers and strings only (no floats).
The first event's prev_hash is GENESIS_HASH. A verifier recomputes each event's commitments (when its salt is still
there), its hash, and the link to the previous event: a changed, deleted, inserted or reordered event breaks it.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import hashlib
import io
import json
import sys
from datetime import UTC
from typing import Any

GENESIS_HASH = "0" * 64
PERSONAL_FIELDS = ("actor_id", "tenant_id", "source_ip", "target_id", "old_values", "new_values")
NON_PERSONAL_FIELDS = ("seq", "occurred_at", "actor_kind", "action", "target_type", "request_id")


# Each action code's name (audit/actions.py's AuditAction, code_name; tests/audit check the two agree): an export's
# `action_name` is verified against it, since no hash covers the label.
ACTION_NAMES = {
    1001: "tenant.created",
    1002: "tenant.updated",
    1003: "quota.updated",
    1101: "key.issued",
    1102: "key.revoked",
    1103: "key.rotated",
    2001: "node.created",
    2002: "node.registered",
    2003: "node.cordoned",
    2004: "node.uncordoned",
    2005: "node.draining",
    2006: "node.lost",
    2007: "node.certificate_issued",
    3001: "cache.attached",
    3002: "cache.ready",
    3003: "cache.failed",
    3004: "cache.detach_requested",
    3005: "cache.detached",
    3006: "cache.migrated",
    3007: "cache.reprovisioned",
    3008: "cache.emptied",
    3009: "cache.recovered",
    3101: "data.token_issued",
    3102: "data.tokens_revoked",
    3201: "engine.registered",
    3202: "engine.deregistered",
    3203: "engine.lost",
    4001: "usage.report_refused",
    4002: "rate.created",
    4003: "invoice.finalised",
    5001: "erasure.requested",
    5002: "erasure.cancelled",
    5003: "erasure.started",
    5004: "erasure.completed",
    5005: "erasure.failed",
    5006: "data.exported",
    6001: "audit.exported",
    6002: "audit.digest_signed",
    6003: "audit.pseudonymised",
    7001: "console.login",
    7002: "console.login_failed",
    7003: "console.logout",
}


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def commitment(salt: bytes, field: str, value: Any) -> str:
    return hashlib.sha256(salt + field.encode() + b"\x00" + canonical(value)).hexdigest()


def commitments_of(salt: bytes, event: dict) -> dict[str, str]:
    return {field: commitment(salt, field, event.get(field)) for field in PERSONAL_FIELDS}


def event_hash(prev_hash: str, event: dict, commitments: dict[str, str]) -> str:
    body = {field: event[field] for field in NON_PERSONAL_FIELDS}
    body["commitments"] = commitments
    return hashlib.sha256(bytes.fromhex(prev_hash) + canonical(body)).hexdigest()


# ---- signed digests -------------------------------------------------------------------------------------------------
# A digest signs the chain's head at the end of a period (CloudTrail-style) and chains to the previous digest:
#   body        = {"format", "version", "period_start", "period_end", "head_seq", "head_hash", "prev_digest_hash",
#                  "key_id"}                       (times: "YYYY-MM-DDTHH:MM:SSZ", UTC, whole seconds)
#   digest_hash = sha256(canonical(body))          (the next digest's prev_digest_hash; GENESIS_HASH for the first)
#   signature   = Ed25519(platform key, canonical(body)), base64url without padding
# head_seq is the last event that occurred before period_end (0 and GENESIS_HASH while the trail is empty).

DIGEST_FORMAT = "kcaas-audit-digest"
EXPORT_FORMAT = "kcaas-audit-export"
FORMAT_VERSION = 1  # the digest body's version
# Export versions: 2 ends with a `signature` record (the platform key over every record before it, so the fields a
# reader reads that no hash covers — action_name, pseudonyms, the header — are verified too); 1 has none.
EXPORT_VERSION = 2
EXPORT_VERSIONS = (1, 2)
EXPORT_SIGNATURE_FORMAT = "kcaas-audit-export-signature"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def format_period_time(moment) -> str:
    """A period bound (an aware datetime) as the digest body writes it."""

    return moment.astimezone(UTC).strftime(TIME_FORMAT)


def digest_body(
    *, period_start: str, period_end: str, head_seq: int, head_hash: str, prev_digest_hash: str, key_id: str
) -> dict:
    return {
        "format": DIGEST_FORMAT,
        "version": FORMAT_VERSION,
        "period_start": period_start,
        "period_end": period_end,
        "head_seq": head_seq,
        "head_hash": head_hash,
        "prev_digest_hash": prev_digest_hash,
        "key_id": key_id,
    }


def digest_hash(body: dict) -> str:
    return hashlib.sha256(canonical(body)).hexdigest()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwk_thumbprint(jwk: dict) -> str:
    """RFC 7638 thumbprint of an OKP JWK (the platform key's `kid`)."""
    members = {"crv": jwk["crv"], "kty": jwk["kty"], "x": jwk["x"]}
    raw = hashlib.sha256(json.dumps(members, separators=(",", ":"), sort_keys=True).encode()).digest()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def signature_valid(jwk: dict, payload: bytes, signature_b64: str) -> bool:
    """Whether `signature_b64` is the Ed25519 signature of `payload` by the OKP/Ed25519 public key `jwk`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        return False
    try:
        Ed25519PublicKey.from_public_bytes(_b64url_decode(jwk["x"])).verify(_b64url_decode(signature_b64), payload)
    except (InvalidSignature, ValueError, TypeError, KeyError):
        return False
    return True


def records_hash(records) -> str:
    """sha256 over canonical(record) + newline of each record, in order: what an export's signature signs (the
    same for its JSONL and CSV forms, which carry the same records)."""
    running = hashlib.sha256()
    for record in records:
        running.update(canonical(record) + b"\n")
    return running.hexdigest()


def export_signature_body(*, records_hash: str, key_id: str) -> dict:
    return {"format": EXPORT_SIGNATURE_FORMAT, "records_hash": records_hash, "key_id": key_id}


# ---- export records -------------------------------------------------------------------------------------------------
# An export is a header record, then the chain segment it covers in seq order (an `event` for each event of the range
# and filter, a `witness` — seq, prev_hash, hash, no personal data — for each other event of the segment), then the
# digests that anchor it, then (version 2) a `signature`: records_hash of every record before it, the key id, and
# the platform's Ed25519 signature of export_signature_body. JSONL: one JSON object per line with a `record_type`.
# CSV: the columns CSV_COLUMNS, one row per record, `record_type` first; ints as decimals, dict/list cells as JSON,
# null as an empty cell (only tenant_id, source_ip and salt may be null; old_values/new_values hold the JSON `null`);
# the header row carries the header object as JSON in the `header` column.

EVENT_FIELDS = (
    "seq",
    "occurred_at",
    "actor_kind",
    "actor_id",
    "tenant_id",
    "action",
    "action_name",
    "target_type",
    "target_id",
    "request_id",
    "source_ip",
    "old_values",
    "new_values",
    "salt",
    "commitments",
    "prev_hash",
    "hash",
)
WITNESS_FIELDS = ("seq", "prev_hash", "hash")
SIGNATURE_FIELDS = ("records_hash", "key_id", "signature")
DIGEST_FIELDS = (
    "period_start",
    "period_end",
    "head_seq",
    "head_hash",
    "prev_digest_hash",
    "key_id",
    "digest_hash",
    "signature",
)
RECORD_FIELDS = {
    "event": EVENT_FIELDS,
    "witness": WITNESS_FIELDS,
    "digest": DIGEST_FIELDS,
    "header": ("header",),
    "signature": SIGNATURE_FIELDS,
}
CSV_COLUMNS = ("record_type", *EVENT_FIELDS, *DIGEST_FIELDS, "records_hash", "header")
_CSV_INT = frozenset({"seq", "action", "head_seq"})
_CSV_JSON = frozenset({"old_values", "new_values", "commitments", "header"})
_CSV_NULLABLE = frozenset({"tenant_id", "source_ip", "salt"})


def csv_row(record: dict) -> list[str]:
    """One export record as a CSV row (see CSV_COLUMNS); the inverse of `record_from_csv`."""
    kind = record["record_type"]
    if kind == "header":
        record = {"header": {k: v for k, v in record.items() if k != "record_type"}}
    fields = RECORD_FIELDS[kind]
    return [kind] + [_csv_cell(column, record.get(column)) if column in fields else "" for column in CSV_COLUMNS[1:]]


def _csv_cell(column: str, value: Any) -> str:
    if column in _CSV_JSON:
        return canonical(value).decode()
    if value is None:
        return ""
    return str(value)


def record_from_csv(row: dict) -> dict:
    kind = row.get("record_type")
    if kind not in RECORD_FIELDS:
        raise ValueError(f"unknown record_type {kind!r}")
    if kind == "header":
        return {"record_type": "header", **json.loads(row["header"])}
    record = {"record_type": kind}
    for column in RECORD_FIELDS[kind]:
        text = row[column]
        if column in _CSV_JSON:
            record[column] = json.loads(text)
        elif column in _CSV_INT:
            record[column] = int(text)
        else:
            record[column] = None if column in _CSV_NULLABLE and text == "" else text
    return record


# ---- verification ---------------------------------------------------------------------------------------------------
# verify_export checks, and names by seq: the header against the records; the sequence (a missing seq is a deleted
# event, a repeated one an inserted event, a seq after a larger one a reordering); every link (prev_hash = the
# previous hash) and event hash; every commitment whose salt is still there; the range and tenant filter; the
# platform key (against a trusted JWK when given); and each digest's hash, key id, signature, link to the previous
# digest and head (the hash of its head_seq in the export's chain).

_HEX64 = frozenset("0123456789abcdef")


@dataclasses.dataclass(frozen=True)
class Problem:
    code: str  # malformed | header_mismatch | deleted | inserted | reordered | broken_link | hash_mismatch |
    # commitment_mismatch | outside_range | outside_filter | unexpected_witness | untrusted_key | digest_*
    message: str
    seq: int | None = None

    def __str__(self) -> str:
        where = f"seq {self.seq}: " if self.seq is not None else ""
        return f"{where}{self.code}: {self.message}"


@dataclasses.dataclass
class Report:
    """What verify_export found: the problems (any one fails the export), notes, counts, and what the verified
    records are covered by: signed spans (a digest signs their chain), chained-only spans (after the last digest:
    tamper-evident against each other, not yet signed), witness-only spans (hashes, no event data), and whether the
    export's own signature (labels, pseudonyms, header) verified."""

    problems: list[Problem] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    events: int = 0
    witnesses: int = 0
    digests: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    signed_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    chained_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # after the last digest's head
    witness_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    next_digest_due: str | None = None  # the end of the period whose digest will sign the first chained-only seq
    export_signed: bool = False  # a version 2 export whose signature verified

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, code: str, message: str, seq: int | None = None) -> None:
        self.problems.append(Problem(code, message, seq))

    def coverage(self) -> list[tuple[str, str]]:
        """(what, which seqs) of what the records are covered by, as the summary says it (the console's rows)."""
        due = f" (signed by the digest of the period ending {self.next_digest_due})" if self.next_digest_due else ""
        return [
            ("Signed by a digest", _spans(self.signed_spans)),
            ("Chained only, not yet signed", _spans(self.chained_spans) + (due if self.chained_spans else "")),
            ("Witnesses only (hashes, no event data)", _spans(self.witness_spans)),
            ("Export signature", "verified" if self.export_signed else "none"),
        ]

    def summary(self) -> str:
        """One line: OK or FAILED, the counts, and (when OK) what is signed, what only chained, what witnessed."""
        span = f"seq {self.first_seq}-{self.last_seq}" if self.first_seq is not None else "no chain records"
        counts = f"{self.events} events, {self.witnesses} witnesses, {self.digests} digests ({span})"
        if not self.ok:
            return f"FAILED: {len(self.problems)} problem(s) in {counts}; first: {self.problems[0]}"
        parts = [f"OK: {counts}", f"signed by a digest: {_spans(self.signed_spans)}"]
        if self.chained_spans:
            due = f", signed by the digest of the period ending {self.next_digest_due}" if self.next_digest_due else ""
            parts.append(f"chained only, not yet signed: {_spans(self.chained_spans)}{due}")
        if self.witness_spans:
            parts.append(f"witnesses only (hashes, no event data): {_spans(self.witness_spans)}")
        parts.append("export signature: verified" if self.export_signed else "export signature: none")
        return "; ".join(parts)


def _spans(spans: list[tuple[int, int]]) -> str:
    if not spans:
        return "none"
    return ", ".join(f"seq {first}" if first == last else f"seq {first}-{last}" for first, last in spans)


def _runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted seqs as maximal runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for seq in seqs:
        if runs and runs[-1][1] == seq - 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return runs


def verify_export(path_or_lines, *, trusted_key_jwk: dict | None = None) -> Report:
    """Verify an export (a path, or an iterable of its lines; JSONL or CSV, detected from the first line)."""
    report = Report()
    records = _parse(_text(path_or_lines), report)
    if not records or records[0]["record_type"] != "header":
        report.add("malformed", "the export does not start with a header record")
        return report
    header, rest = records[0], records[1:]
    chain_records = [r for r in rest if r["record_type"] in ("event", "witness")]
    digests = [r for r in rest if r["record_type"] == "digest"]
    signatures = [index for index, r in enumerate(records) if r["record_type"] == "signature"]
    for record in rest:
        if record["record_type"] == "header":
            report.add("malformed", "a second header record")
    if signatures and signatures != [len(records) - 1]:
        report.add("malformed", "a signature record that is not the export's one last record")
    report.events = sum(r["record_type"] == "event" for r in chain_records)
    report.witnesses, report.digests = len(chain_records) - report.events, len(digests)
    try:
        ordered = _check_sequence(chain_records, report)
        _check_header(header, ordered, report)
        _check_links(ordered, report)
        _check_filter(header, ordered, report)
        key = _check_key(header.get("platform_key"), trusted_key_jwk, report)
        _check_digests(digests, key, ordered, report)
        _check_export_signature(header, records, key, report)
        _cover(header, digests, ordered, report)
    except (TypeError, ValueError, KeyError, AttributeError) as error:  # a shape _validated does not catch
        report.add("malformed", f"cannot check the export: {type(error).__name__}: {error}")
    return report


def _text(path_or_lines) -> str:
    if isinstance(path_or_lines, (str, bytes)) or hasattr(path_or_lines, "__fspath__"):
        with open(path_or_lines, encoding="utf-8", newline="") as f:
            return f.read()
    return "".join(line.decode() if isinstance(line, bytes) else line for line in path_or_lines)


def _parse(text: str, report: Report) -> list[dict]:
    """JSONL (lines split on \\n only: a JSON string may hold U+2028) or CSV (quoted cells may span lines)."""
    jsonl = text.lstrip().startswith("{")
    if jsonl:
        rows = enumerate(text.split("\n"), start=1)
    else:
        rows = enumerate(csv.DictReader(io.StringIO(text, newline="")), start=2)
    records = []
    while True:
        try:
            line_no, item = next(rows)
        except StopIteration:
            return records
        except csv.Error as error:
            report.add("malformed", f"CSV: {error}")
            return records
        if jsonl and not item.strip():
            continue
        try:
            records.append(_validated(json.loads(item) if jsonl else record_from_csv(item)))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            report.add("malformed", f"line {line_no}: {error}")


def _validated(record: dict) -> dict:
    if not isinstance(record, dict):
        raise TypeError("a record must be an object")
    kind = record.get("record_type")
    if kind not in RECORD_FIELDS:
        raise ValueError(f"unknown record_type {kind!r}")
    if kind == "header":
        return record
    missing = [name for name in RECORD_FIELDS[kind] if name not in record]
    if missing:
        raise KeyError(f"{kind} record lacks {', '.join(missing)}")
    for name in ("seq", "action", "head_seq"):
        if name in RECORD_FIELDS[kind] and (type(record[name]) is not int or record[name] < 0):
            raise TypeError(f"{name} must be a non-negative integer")
    for name in ("prev_hash", "hash", "head_hash", "prev_digest_hash", "digest_hash", "records_hash"):
        value = record.get(name)
        if name in RECORD_FIELDS[kind] and not (isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64):
            raise ValueError(f"{name} must be 64 lowercase hex digits")
    if kind == "event":
        if record["salt"] is not None:
            bytes.fromhex(record["salt"])
        if not isinstance(record["commitments"], dict):
            raise TypeError("commitments must be an object")
    return record


def _check_sequence(records: list[dict], report: Report) -> list[dict]:
    """The records in seq order, first copy of each seq; problems for repeated, reordered and missing seqs."""
    kept: dict[int, dict] = {}
    highest = None
    for record in records:
        seq = record["seq"]
        if seq in kept:
            report.add("inserted", "this seq appears more than once (an inserted or duplicated record)", seq)
            continue
        if highest is not None and seq < highest:
            report.add("reordered", f"comes after seq {highest} (records reordered)", seq)
        kept[seq] = record
        highest = seq if highest is None else max(highest, seq)
    ordered = [kept[seq] for seq in sorted(kept)]
    for before, after in zip(ordered, ordered[1:]):
        if after["seq"] != before["seq"] + 1:
            gone = f"{before['seq'] + 1}" + (f"-{after['seq'] - 1}" if after["seq"] - before["seq"] > 2 else "")
            report.add("deleted", f"seq {gone} missing before it (deleted records)", after["seq"])
    if ordered:
        report.first_seq, report.last_seq = ordered[0]["seq"], ordered[-1]["seq"]
    return ordered


def _check_header(header: dict, ordered: list[dict], report: Report) -> None:
    if header.get("format") != EXPORT_FORMAT or header.get("version") not in EXPORT_VERSIONS:
        versions = " or ".join(str(v) for v in EXPORT_VERSIONS)
        report.add("malformed", f"not a {EXPORT_FORMAT} version {versions} export")
    claimed = {"first_seq": header.get("first_seq"), "last_seq": header.get("last_seq"), "counts": header.get("counts")}
    found = {
        "first_seq": report.first_seq,
        "last_seq": report.last_seq,
        "counts": {"event": report.events, "witness": report.witnesses, "digest": report.digests},
    }
    for name, value in found.items():
        if claimed[name] != value:
            report.add("header_mismatch", f"the header says {name} {claimed[name]}, the records give {value}")


def _check_links(ordered: list[dict], report: Report) -> None:
    for index, record in enumerate(ordered):
        seq = record["seq"]
        previous = ordered[index - 1] if index else None
        if seq == 1 and record["prev_hash"] != GENESIS_HASH:
            report.add("broken_link", "the first event's prev_hash is not the genesis hash", seq)
        elif previous is not None and previous["seq"] == seq - 1 and record["prev_hash"] != previous["hash"]:
            report.add("broken_link", f"prev_hash is not the hash of seq {seq - 1}", seq)
        if record["record_type"] == "event":
            _check_event(record, report)


def _check_event(record: dict, report: Report) -> None:
    seq = record["seq"]
    if record["salt"] is not None:
        expected = commitments_of(bytes.fromhex(record["salt"]), record)
        for field in PERSONAL_FIELDS:
            if record["commitments"].get(field) != expected[field]:
                report.add("commitment_mismatch", f"{field} does not match its commitment (changed)", seq)
    try:
        recomputed = event_hash(record["prev_hash"], record, record["commitments"])
    except (TypeError, ValueError) as error:
        report.add("malformed", f"cannot hash the event: {error}", seq)
        return
    if recomputed != record["hash"]:
        report.add(
            "hash_mismatch",
            "the event's hashed fields ("
            + ", ".join(NON_PERSONAL_FIELDS)
            + ", commitments) do not match its hash (changed)",
            seq,
        )
    name = ACTION_NAMES.get(record["action"])
    if name is None:
        report.notes.append(f"seq {seq}: action {record['action']} is unknown to this verifier: its name is unchecked")
    elif record["action_name"] != name:
        report.add("label_mismatch", f"action_name {record['action_name']!r} is not action {record['action']}'s", seq)


def _check_filter(header: dict, ordered: list[dict], report: Report) -> None:
    wanted_tenant = (header.get("filter") or {}).get("tenant_id")
    window = header.get("range") or {}
    try:
        start, end = _moment(window.get("from")), _moment(window.get("to"))
    except (TypeError, ValueError, AttributeError):
        report.add("malformed", "the header's range is not two ISO 8601 times")
        start = end = None
    events = [i for i, r in enumerate(ordered) if r["record_type"] == "event"]
    for index, record in enumerate(ordered):
        seq = record["seq"]
        if record["record_type"] == "witness":
            if wanted_tenant is None and events and events[0] < index < events[-1]:
                report.add("unexpected_witness", "a witness among the events of an unfiltered export", seq)
            continue
        if wanted_tenant is not None and record["tenant_id"] != wanted_tenant:
            report.add("outside_filter", f"tenant_id {record['tenant_id']} is not the filter's {wanted_tenant}", seq)
        try:
            outside = start is not None and not start <= _moment(record["occurred_at"]) < end
        except (TypeError, ValueError, AttributeError):
            outside = True
        if outside:
            report.add("outside_range", f"occurred_at {record['occurred_at']} is outside the export's range", seq)


def _moment(text):
    from datetime import datetime

    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError("a time without a zone")
    return moment


def _check_key(export_key, trusted_key: dict | None, report: Report) -> dict | None:
    """The key to verify the digests with: the trusted one when given (the export's must be it), else the export's."""
    if not isinstance(export_key, dict) or "x" not in export_key:
        report.add("malformed", "the header carries no platform_key JWK")
        export_key = None
    if trusted_key is not None and not isinstance(trusted_key, dict):
        report.add("malformed", "the trusted key is not a JWK object")
        trusted_key = {}
    if trusted_key is None:
        report.notes.append("platform key not pinned (pass --key): digests checked against the key in the export")
        return export_key
    if export_key is not None and export_key.get("x") != trusted_key.get("x"):
        report.add(
            "untrusted_key",
            f"the export's platform key (kid {export_key.get('kid')}) is not the trusted "
            f"key (kid {trusted_key.get('kid')})",
        )
    return trusted_key


def _check_digests(digests: list[dict], key: dict | None, ordered: list[dict], report: Report) -> None:
    by_seq = {record["seq"]: record for record in ordered}
    previous = None
    for digest in digests:
        period = f"digest {digest['period_start']}..{digest['period_end']}"
        _check_digest_signature(digest, key, period, report)
        if previous is not None and (
            digest["prev_digest_hash"] != previous["digest_hash"] or digest["period_start"] != previous["period_end"]
        ):
            report.add("digest_chain_broken", f"{period} does not follow the digest before it")
        _check_digest_head(digest, by_seq, period, report)
        previous = digest
    _note_anchoring(digests, ordered, report)


def _check_digest_signature(digest: dict, key: dict | None, period: str, report: Report) -> None:
    body = digest_body(
        **{
            name: digest[name]
            for name in ("period_start", "period_end", "head_seq", "head_hash", "prev_digest_hash", "key_id")
        }
    )
    if digest_hash(body) != digest["digest_hash"]:
        report.add("digest_hash_mismatch", f"{period}: digest_hash is not the hash of its body (changed)")
    if key is None:
        return
    if digest["key_id"] != key.get("kid") and digest["key_id"] != _thumbprint_or_none(key):
        report.add("digest_key_mismatch", f"{period}: signed by key {digest['key_id']}, not {key.get('kid')}")
    if not signature_valid(key, canonical(body), digest["signature"]):
        report.add("digest_signature_invalid", f"{period}: the signature does not verify with the platform key")


def _thumbprint_or_none(key: dict) -> str | None:
    try:
        return jwk_thumbprint(key)
    except KeyError:
        return None


def _check_digest_head(digest: dict, by_seq: dict, period: str, report: Report) -> None:
    head_seq, head_hash = digest["head_seq"], digest["head_hash"]
    if head_seq == 0:
        if head_hash != GENESIS_HASH:
            report.add("digest_head_mismatch", f"{period}: an empty chain's head must be the genesis hash")
        return
    if head_seq in by_seq:
        actual = by_seq[head_seq]["hash"]
    elif head_seq + 1 in by_seq:
        actual = by_seq[head_seq + 1]["prev_hash"]
    else:
        if by_seq:
            report.add(
                "digest_not_covered",
                f"{period}: its head is not in the export's chain (records removed at an end?)",
                head_seq,
            )
        return
    if actual != head_hash:
        report.add(
            "digest_head_mismatch",
            f"{period}: signs head hash {head_hash[:16]}…, the chain has {actual[:16]}…",
            head_seq,
        )


def _note_anchoring(digests: list[dict], ordered: list[dict], report: Report) -> None:
    if not ordered:
        return
    if not digests:
        report.notes.append("no digests: the chain is consistent but no signature anchors it")
        return
    first = ordered[0]["seq"]
    if first > 1 and not any(d["head_seq"] == first - 1 for d in digests):
        report.notes.append(f"the chain's start (seq {first}) is not anchored by a digest")


def _check_export_signature(header: dict, records: list[dict], key: dict | None, report: Report) -> None:
    """Version 2: the last record signs every record before it (so action_name, pseudonymised fields and the header
    are verified too). Version 1 has no signature: a note says what is then left unverified."""
    signature = records[-1] if records[-1]["record_type"] == "signature" else None
    if header.get("version") == 1 and signature is None:
        report.notes.append(
            "a version 1 export carries no export signature: the header and pseudonymised personal fields are "
            "not verified (action names are checked against this verifier's table)"
        )
        return
    if signature is None:
        report.add("export_unsigned", "the export lacks its signature record (its last records removed?)")
        return
    if records_hash(records[:-1]) != signature["records_hash"]:
        report.add("export_signature_mismatch", "the records do not hash to what the export's signature signs")
    if key is None:
        return
    if signature["key_id"] != key.get("kid") and signature["key_id"] != _thumbprint_or_none(key):
        report.add("export_signature_key_mismatch", f"signed by key {signature['key_id']}, not {key.get('kid')}")
    body = export_signature_body(records_hash=signature["records_hash"], key_id=signature["key_id"])
    if not signature_valid(key, canonical(body), signature["signature"]):
        report.add("export_signature_invalid", "the export's signature does not verify with the platform key")
    report.export_signed = not any(p.code.startswith("export_signature") for p in report.problems)


def _cover(header: dict, digests: list[dict], ordered: list[dict], report: Report) -> None:
    """What signs what: seqs up to the highest digest head in the chain are signed by it; the rest only chained."""
    heads = [d["head_seq"] for d in digests if any(r["seq"] == d["head_seq"] for r in ordered)]
    signed_through = max(heads, default=0)
    report.signed_spans = _runs([r["seq"] for r in ordered if r["seq"] <= signed_through])
    report.chained_spans = _runs([r["seq"] for r in ordered if r["seq"] > signed_through])
    report.witness_spans = _runs([r["seq"] for r in ordered if r["record_type"] == "witness"])
    pseudonymised = [r["seq"] for r in ordered if r["record_type"] == "event" and r["salt"] is None]
    if pseudonymised:
        report.notes.append(
            f"{len(pseudonymised)} events are pseudonymised ({_spans(_runs(pseudonymised))}): their personal fields "
            "hold pseudonyms, bound to the chain by commitments that no longer open"
            + ("; the export signature covers the pseudonyms" if report.export_signed else "")
        )
    unsigned = [r for r in ordered if r["seq"] > signed_through and r["record_type"] == "event"]
    period = header.get("digest_period_seconds")
    if unsigned and type(period) is int and period > 0:
        occurred = int(_moment(unsigned[0]["occurred_at"]).timestamp())
        from datetime import datetime

        end = datetime.fromtimestamp(occurred // period * period + period, tz=UTC)
        report.next_digest_due = end.strftime(TIME_FORMAT)


# ---- command line ---------------------------------------------------------------------------------------------------


def report_lines(report: Report, *, max_problems: int = 20) -> list[str]:
    """The one-line summary, then the first problems and the notes."""
    lines = [report.summary()] + [f"  {problem}" for problem in report.problems[:max_problems]]
    if len(report.problems) > max_problems:
        lines.append(f"  ... and {len(report.problems) - max_problems} more")
    return lines + [f"  note: {note}" for note in report.notes]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="chain.py", description="Verify a KCaaS audit export offline.")
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="verify an export (JSONL or CSV); exit 0 when it all verifies")
    verify.add_argument("export")
    verify.add_argument("--key", help="the trusted platform key: a JWK file (/.well-known/kcaas-platform-key.json)")
    verify.add_argument("--max-problems", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        trusted = _read_json(args.key) if args.key else None
        report = verify_export(args.export, trusted_key_jwk=trusted)
    except (OSError, ValueError) as error:
        print(f"cannot read the export or the key: {error}", file=sys.stderr)
        return 2
    print("\n".join(report_lines(report, max_problems=args.max_problems)))
    return 0 if report.ok else 1


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
