"""Signed digests: one per closed period, chained, signed by the platform key, idempotent, empty periods included,
and no audit event of their own."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit import chain
from audit.digests import audit_digest_sign, period_floor
from audit.keys import platform_public_jwk
from audit.models import AuditDigest, AuditEvent
from audit.tasks import sign_digests

from .helpers import next_second, record

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def one_second_periods(settings):
    settings.KCAAS_AUDIT_DIGEST_SECONDS = 1


def assert_digest_verifies(digest: AuditDigest) -> None:
    record = digest.record()
    body = chain.digest_body(
        **{k: record[k] for k in ("period_start", "period_end", "head_seq", "head_hash", "prev_digest_hash", "key_id")}
    )
    assert chain.digest_hash(body) == digest.digest_hash
    assert chain.signature_valid(platform_public_jwk(), chain.canonical(body), digest.signature)
    assert digest.key_id == platform_public_jwk()["kid"] == chain.jwk_thumbprint(platform_public_jwk())


def test_digests_chain_sign_the_head_and_cover_empty_periods():
    tenant = uuid.uuid4()
    first = record(tenant)
    second = record(tenant)
    next_second()
    created = audit_digest_sign(now=timezone.now() + timedelta(seconds=2))
    assert len(created) >= 3  # the events' period and at least two empty ones after it
    digests = list(AuditDigest.objects.order_by("period_start"))
    assert digests == created
    assert digests[0].period_start == period_floor(first.occurred_at, 1)
    assert digests[0].prev_digest_hash == chain.GENESIS_HASH
    for before, after in zip(digests, digests[1:]):
        assert after.period_start == before.period_end and after.prev_digest_hash == before.digest_hash
    assert all((d.head_seq, d.head_hash) == (second.seq, second.hash) for d in digests)  # empty periods: same head
    for digest in digests:
        assert_digest_verifies(digest)
    assert AuditEvent.objects.count() == 2  # signing records no event in the chain it signs


def test_signing_is_idempotent_and_only_closed_periods_are_signed():
    record(uuid.uuid4())
    now = timezone.now()
    created = audit_digest_sign(now=now)
    assert all(d.period_end <= now for d in created)
    assert audit_digest_sign(now=now) == []  # twice: nothing new
    count = AuditDigest.objects.count()
    next_second()
    later = record(uuid.uuid4())
    next_second()
    new = audit_digest_sign()
    assert new and AuditDigest.objects.count() == count + len(new)
    assert len({d.period_start for d in AuditDigest.objects.all()}) == AuditDigest.objects.count()
    assert new[-1].head_seq == later.seq
    previous = AuditDigest.objects.filter(period_end=new[0].period_start).first()
    assert previous is not None and new[0].prev_digest_hash == previous.digest_hash  # continues the chain


def test_an_empty_trail_gets_a_genesis_digest_and_the_beat_task_signs():
    assert sign_digests.apply().get() == 1  # the last closed period, nothing recorded yet
    digest = AuditDigest.objects.get()
    assert (digest.head_seq, digest.head_hash, digest.prev_digest_hash) == (0, chain.GENESIS_HASH, chain.GENESIS_HASH)
    assert_digest_verifies(digest)
    assert sign_digests.apply().get() in (0, 1)  # at most the one period that closed meanwhile


def test_the_beat_schedule_runs_the_signer(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["audit-sign-digests"]
    assert entry["task"] == sign_digests.name == "audit.sign_digests" and entry["schedule"] <= 3600


def test_digests_are_append_only_in_the_database():
    from django.db import connection, transaction

    audit_digest_sign()
    for sql in ("UPDATE audit_auditdigest SET head_seq = 7", "DELETE FROM audit_auditdigest"):
        with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql)
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL kcaas.audit_allow_truncate = 'off'")
        cursor.execute("TRUNCATE audit_auditdigest")
    assert AuditDigest.objects.count() == 1
