"""Signed digests of the audit chain (CloudTrail-style): one per closed period, chained, signed by the platform key.

Invariants:
- periods are aligned to multiples of settings.KCAAS_AUDIT_DIGEST_SECONDS since the Unix epoch (hourly by default)
  and contiguous: each digest starts where the previous one ended; the first starts at the period of the first
  event (or the last closed period while the trail is empty);
- a period is signed once it has closed (period_end <= now), and only once (period_start is unique; signers
  serialize on the chain head's row lock), so running the signer twice signs nothing new;
- a period without new events still gets a digest, with the same head as the previous one, chained to it;
- the head of a period is the last event that occurred before its end. Events take their time under the chain
  head's lock, so holding that lock while signing means no event of a closed period can still be uncommitted.

Signing writes no audit event: an hourly event in the chain it signs would make every period non-empty (each digest
would sign, in the next period, the event of the previous signature) and bury the trail in bookkeeping. The digests
table is itself the record of signing, and every digest is in every export that it anchors.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit import chain
from audit.keys import platform_public_jwk, platform_sign
from audit.models import AuditChainHead, AuditDigest, AuditEvent

MAX_PERIODS_PER_RUN = 24 * 31  # a run catches up at most a month; the next run continues


def period_seconds() -> int:
    return int(getattr(settings, "KCAAS_AUDIT_DIGEST_SECONDS", 3600))


def period_floor(moment: datetime, seconds: int) -> datetime:
    """The start of the period containing `moment`."""
    stamp = int(moment.timestamp()) // seconds * seconds
    return datetime.fromtimestamp(stamp, tz=UTC)


def audit_digest_sign(now: datetime | None = None) -> list[AuditDigest]:
    """Sign every closed period not yet signed (at most MAX_PERIODS_PER_RUN); return the new digests in order."""
    now = now or timezone.now()
    seconds = period_seconds()
    closed_until = period_floor(now, seconds)
    with transaction.atomic():
        _lock_chain_head()
        last = AuditDigest.objects.order_by("-period_start").first()
        start = last.period_end if last else _first_period_start(closed_until, seconds)
        prev_hash = last.digest_hash if last else chain.GENESIS_HASH
        created = []
        while len(created) < MAX_PERIODS_PER_RUN:
            end = period_floor(start, seconds) + timedelta(seconds=seconds)
            if end > closed_until:
                break
            digest = _sign_period(start, end, prev_hash)
            created.append(digest)
            start, prev_hash = end, digest.digest_hash
    return created


def _lock_chain_head() -> None:
    AuditChainHead.objects.bulk_create([AuditChainHead(id=1, seq=0, hash=chain.GENESIS_HASH)], ignore_conflicts=True)
    AuditChainHead.objects.select_for_update(no_key=True).get(pk=1)


def _first_period_start(closed_until: datetime, seconds: int) -> datetime:
    first_event = AuditEvent.objects.order_by("seq").values_list("occurred_at", flat=True).first()
    if first_event is None or first_event >= closed_until:
        return closed_until - timedelta(seconds=seconds)
    return period_floor(first_event, seconds)


def _sign_period(start: datetime, end: datetime, prev_digest_hash: str) -> AuditDigest:
    head = AuditEvent.objects.filter(occurred_at__lt=end).order_by("-seq").values("seq", "hash").first()
    head_seq, head_hash = (head["seq"], head["hash"]) if head else (0, chain.GENESIS_HASH)
    key_id = platform_public_jwk()["kid"]
    body = chain.digest_body(
        period_start=chain.format_period_time(start),
        period_end=chain.format_period_time(end),
        head_seq=head_seq,
        head_hash=head_hash,
        prev_digest_hash=prev_digest_hash,
        key_id=key_id,
    )
    signed_by, signature = platform_sign(chain.canonical(body))
    assert signed_by == key_id, "the platform key changed while signing"
    return AuditDigest.objects.create(
        period_start=start,
        period_end=end,
        head_seq=head_seq,
        head_hash=head_hash,
        prev_digest_hash=prev_digest_hash,
        digest_hash=chain.digest_hash(body),
        key_id=key_id,
        signature=signature,
        signed_at=timezone.now(),
    )
