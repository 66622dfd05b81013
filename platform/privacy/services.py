"""Writes of the privacy room: the erasure job's state machine (GDPR Art. 17).

    request -> pending -> scheduled (grace: KCAAS_ERASURE_GRACE_SECONDS, cancellable)
            -> running   (beat, past the grace: tenant erasing, keys and data tokens revoked, caches detached and
                          their reservations released, kcaas.node.purge_tenant sent to every registered node)
            -> complete  (every node answered privacy.purge_result: tenant key destroyed, personal data deleted or
                          pseudonymised, audit trail pseudonymised, receipt signed)
    a failing step -> error (a new request re-schedules it at once); cancel -> cancelled (pending/scheduled only).

Invariants:
- every step is idempotent and status-guarded under row locks, so redelivered tasks, a second beat and retries
  change nothing twice; each step's audit event is written in the step's own transaction;
- lock order: tenant -> job -> purge rows (confirmations lock job -> purge rows; the register hook only purge rows);
- a node that is lost when the job starts gets no message then: its purge stays pending, and is sent when it
  registers again (KCAAS_NODE_REGISTER_HOOKS -> erasure_node_registered); the job completes only after it answers;
- messages to nodes are sent on commit (nothing is sent for a rolled-back step).
"""

from __future__ import annotations

import hashlib
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.actions import AuditAction
from audit.context import SYSTEM, actor_of
from audit.services import audit_record, tenant_pseudonym
from caches.services import caches_detach_tenant
from core.celery import app as celery_app
from core.errors import ConflictError, NotFoundError
from core.ids import as_uuid
from fleet.models import Node, NodeState
from fleet.outbox import order_enqueue
from kcaas.node_protocol.messages import CONTROL_QUEUE, PurgeTenant
from privacy import receipt as receipts
from privacy.erasure import erase_tenant_data
from privacy.models import CANCELLABLE_STATES, ErasureJob, ErasurePurge, ErasureState, PurgeState
from routing.services import instances_forget_tenant
from tenants.models import ApiKey, Tenant
from tenants.services import tenant_lock

logger = logging.getLogger("kcaas.privacy")

FINISH_TASK = "privacy.erasure_finish"
MAX_ERROR_LENGTH = 500


def _audit(action: AuditAction, job: ErasureJob, *, tenant_id, old=None, new=None) -> None:
    audit_record(action=action, target_type="erasure_job", target_id=job.pk, tenant_id=tenant_id, old=old, new=new)


def _live_job(tenant_id, *, lock: bool = False) -> ErasureJob | None:
    jobs = ErasureJob.objects.filter(tenant_id=tenant_id).exclude(state=ErasureState.CANCELLED)
    return (jobs.select_for_update(no_key=True) if lock else jobs).first()


def _lock_job(job_id) -> ErasureJob | None:
    wanted = as_uuid(job_id)
    return ErasureJob.objects.select_for_update(no_key=True).filter(pk=wanted).first() if wanted else None


# ---- request / cancel -----------------------------------------------------------------------------------------------


def erasure_requester(user) -> str:
    """How a job records who asked for it: the caller's audit actor as `kind:id` ("system:" for nobody)."""
    actor = actor_of(user) or SYSTEM
    return f"{actor.kind}:{actor.id}"


@transaction.atomic
def erasure_request(*, tenant_id, requested_by: str, now: datetime | None = None) -> tuple[ErasureJob, bool]:
    """Ask for the tenant's erasure: (job, created). Idempotent: while a job that is not cancelled exists, it is
    returned unchanged (created False), except a job in `error`, which is re-scheduled to run at once (a retry).
    404 for an unknown tenant."""
    now = now or timezone.now()
    tenant = tenant_lock(tenant_id=tenant_id)
    job = _live_job(tenant.pk, lock=True)
    if job is not None:
        if job.state == ErasureState.ERROR:
            _retry(job, now)
        return job, False
    job = ErasureJob.objects.create(tenant_id=tenant.pk, requested_by=requested_by[:200], requested_at=now)
    job.scheduled_for = now + timedelta(seconds=settings.KCAAS_ERASURE_GRACE_SECONDS)
    job.state = ErasureState.SCHEDULED  # pending -> scheduled in the request's own transaction
    job.save(update_fields=["scheduled_for", "state", "updated_at"])
    _audit(
        AuditAction.ERASURE_REQUESTED,
        job,
        tenant_id=tenant.pk,
        new={"state": job.state, "scheduled_for": job.scheduled_for},
    )
    return job, True


def _retry(job: ErasureJob, now: datetime) -> None:
    old_error = job.error
    job.state, job.scheduled_for, job.error = ErasureState.SCHEDULED, now, ""
    job.save(update_fields=["state", "scheduled_for", "error", "updated_at"])
    _audit(
        AuditAction.ERASURE_REQUESTED,
        job,
        tenant_id=job.tenant_id,
        old={"state": ErasureState.ERROR, "error": old_error},
        new={"state": job.state, "retry": True},
    )


@transaction.atomic
def erasure_cancel(*, tenant_id) -> ErasureJob:
    """Cancel the tenant's erasure inside its grace window. Cancelling a cancelled job returns it (idempotent);
    409 `erasure_not_cancellable` once it runs (or ran); 404 when the tenant has no erasure job."""
    tenant = tenant_lock(tenant_id=tenant_id)
    job = _live_job(tenant.pk, lock=True)
    if job is None:
        cancelled = ErasureJob.objects.filter(tenant_id=tenant.pk, state=ErasureState.CANCELLED).first()
        if cancelled is None:
            raise NotFoundError("No erasure job for this tenant.")
        return cancelled
    if job.state not in CANCELLABLE_STATES:
        raise ConflictError(
            f"The erasure is {job.state}; only a pending or scheduled one can be cancelled.",
            code="erasure_not_cancellable",
            details={"state": job.state},
        )
    old_state = job.state
    job.state, job.cancelled_at = ErasureState.CANCELLED, timezone.now()
    job.save(update_fields=["state", "cancelled_at", "updated_at"])
    _audit(AuditAction.ERASURE_CANCELLED, job, tenant_id=tenant.pk, old={"state": old_state}, new={"state": job.state})
    return job


# ---- running: suspend, revoke, detach, purge on every node ----------------------------------------------------------


@transaction.atomic
def erasure_start(*, job_id, now: datetime | None = None) -> ErasureJob | None:
    """scheduled (past its grace) -> running. Anything else is returned unchanged."""
    now = now or timezone.now()
    peek = ErasureJob.objects.filter(pk=as_uuid(job_id)).first()
    if peek is None:
        return None
    tenant = tenant_lock(tenant_id=peek.tenant_id)
    job = _lock_job(job_id)
    assert job is not None, "an erasure job is never deleted: the one peeked at is there to lock"
    if job.state != ErasureState.SCHEDULED or job.scheduled_for > now:
        return job
    tenant.status = Tenant.Status.ERASING
    tenant.save(update_fields=["status"])
    keys_revoked = ApiKey.objects.filter(tenant_id=tenant.pk, revoked_at__isnull=True).update(revoked_at=now)
    detached = caches_detach_tenant(tenant_id=tenant.pk)
    engines_forgotten = instances_forget_tenant(tenant_id=tenant.pk)  # its engines' index: prompts' tokens, hashed
    purges = _plan_purges(job)
    _send_purges(job, [p for p in purges if p.state == PurgeState.PENDING], now)
    job.state, job.started_at, job.attempts = ErasureState.RUNNING, job.started_at or now, job.attempts + 1
    job.save(update_fields=["state", "started_at", "attempts", "updated_at"])
    _audit(
        AuditAction.ERASURE_STARTED,
        job,
        tenant_id=tenant.pk,
        old={"state": ErasureState.SCHEDULED},
        new={
            "state": job.state,
            "api_keys_revoked": keys_revoked,
            "caches_detached": len(detached),
            "engine_instances_forgotten": engines_forgotten,
            "nodes": len(purges),
        },
    )
    if not any(p.state == PurgeState.PENDING for p in purges):
        transaction.on_commit(lambda: _enqueue_finish(job.pk), robust=True)
    return job


def _plan_purges(job: ErasureJob) -> list[ErasurePurge]:
    """One purge row per node that ever registered (a tenant may have had caches anywhere); existing rows (a retry)
    keep their state."""
    node_ids = Node.objects.filter(registered_at__isnull=False).values_list("id", flat=True)
    ErasurePurge.objects.bulk_create([ErasurePurge(job=job, node_id=n) for n in node_ids], ignore_conflicts=True)
    return list(ErasurePurge.objects.select_for_update(no_key=True).filter(job=job).order_by("node_id"))


def _send_purges(job: ErasureJob, purges: list[ErasurePurge], now: datetime) -> int:
    """Send purge_tenant (on commit) to those of `purges` whose node is not lost; returns how many were sent."""
    nodes = Node.objects.filter(pk__in=[p.node_id for p in purges], state=NodeState.LOST)
    lost = set(nodes.values_list("id", flat=True))
    sent = 0
    for purge in purges:
        if purge.node_id in lost:
            continue
        # through the outbox (no answer awaited there: the purge rows resend after KCAAS_ERASURE_RESEND_SECONDS)
        order_enqueue(
            node_id=purge.node_id,
            message=PurgeTenant(tenant_id=str(job.tenant_id), job_id=str(job.pk)),
            key=f"purge:{job.pk}",
            expects_answer=False,
        )
        purge.send_count, purge.last_sent_at = purge.send_count + 1, now
        purge.save(update_fields=["send_count", "last_sent_at"])
        sent += 1
    return sent


def _enqueue_finish(job_id) -> None:
    celery_app.send_task(FINISH_TASK, args=[str(job_id)], queue=CONTROL_QUEUE)


@transaction.atomic
def erasure_node_registered(*, node_id, **_) -> int:
    """The fleet register hook (KCAAS_NODE_REGISTER_HOOKS): resend every pending purge of a running erasure to a
    node that (re-)registered — typically one that was lost while the erasure ran. Returns how many were sent."""
    purges = list(
        ErasurePurge.objects.select_for_update(of=("self",), no_key=True)
        .select_related("job")
        .filter(node_id=node_id, state=PurgeState.PENDING, job__state=ErasureState.RUNNING)
        .order_by("job_id")
    )
    now = timezone.now()
    return sum(_send_purges(purge.job, [purge], now) for purge in purges)


def _clean_purged(purged) -> list[dict]:
    """The node's [{"cache_id", "freed_bytes"}], kept only in that shape (non-negative integers)."""
    entries = []
    for entry in purged if isinstance(purged, list) else []:
        if not isinstance(entry, dict):
            continue
        freed = entry.get("freed_bytes")
        freed = freed if isinstance(freed, int) and not isinstance(freed, bool) and freed >= 0 else 0
        entries.append({"cache_id": str(entry.get("cache_id", ""))[:64], "freed_bytes": freed})
    return sorted(entries, key=lambda e: e["cache_id"])


@transaction.atomic
def erasure_purge_confirmed(*, job_id, node_id, tenant_id, purged) -> ErasurePurge | None:
    """A node's privacy.purge_result: its purge row pending -> confirmed with the bytes it freed; when no purge of
    the job is pending any more, the finish is enqueued. Duplicates, unknown jobs/nodes and answers naming another
    tenant change nothing."""
    job = _lock_job(job_id)  # serializes the confirmations of one job: the last one always sees none pending
    node = as_uuid(node_id)
    if job is None or node is None or str(job.tenant_id) != str(tenant_id):
        logger.info("ignored purge result for job %s from node %s", job_id, node_id)
        return None
    purge = ErasurePurge.objects.select_for_update(no_key=True).filter(job=job, node_id=node).first()
    if purge is None or purge.state == PurgeState.CONFIRMED:
        return purge
    entries = _clean_purged(purged)
    purge.state, purge.confirmed_at = PurgeState.CONFIRMED, timezone.now()
    purge.purged_caches, purge.freed_bytes = entries, sum(e["freed_bytes"] for e in entries)
    purge.save(update_fields=["state", "confirmed_at", "purged_caches", "freed_bytes"])
    if job.state == ErasureState.RUNNING and not job.purges.filter(state=PurgeState.PENDING).exists():
        transaction.on_commit(lambda: _enqueue_finish(job.pk), robust=True)
    return purge


# ---- complete: shred, delete, pseudonymise, sign ---------------------------------------------------------------------


@transaction.atomic
def erasure_finish(*, job_id) -> ErasureJob | None:
    """running with every purge confirmed -> complete. Anything else is returned unchanged (so a duplicate finish,
    or one sent before the last confirmation, is a no-op)."""
    peek = ErasureJob.objects.filter(pk=as_uuid(job_id)).first()
    if peek is None:
        return None
    tenant = tenant_lock(tenant_id=peek.tenant_id)
    job = _lock_job(job_id)
    assert job is not None, "an erasure job is never deleted: the one peeked at is there to lock"
    if job.state != ErasureState.RUNNING or job.purges.filter(state=PurgeState.PENDING).exists():
        return job
    now = timezone.now()
    facts = erase_tenant_data(tenant=tenant)
    job.receipt = _receipt_body(job, facts, now)
    job.receipt_key_id, job.receipt_signature = receipts.receipt_sign(job.receipt)
    job.state, job.completed_at = ErasureState.COMPLETE, now
    job.save(update_fields=["receipt", "receipt_key_id", "receipt_signature", "state", "completed_at", "updated_at"])
    digest = hashlib.sha256(receipts.canonical(job.receipt)).hexdigest()
    _audit(
        AuditAction.ERASURE_COMPLETED,
        job,
        tenant_id=tenant_pseudonym(job.tenant_id),
        old={"state": ErasureState.RUNNING},
        new={"state": job.state, "receipt_sha256": digest},
    )
    return job


def _receipt_body(job: ErasureJob, facts: dict, now: datetime) -> dict:
    nodes = [
        {
            "node_id": str(p.node_id),
            "confirmed_at": receipts.iso(p.confirmed_at),
            "freed_bytes": p.freed_bytes,
            "caches": p.purged_caches,
        }
        for p in job.purges.order_by("node_id")
    ]
    return {
        "type": receipts.RECEIPT_TYPE,
        "version": receipts.RECEIPT_VERSION,
        "job_id": str(job.pk),
        "tenant_id": str(job.tenant_id),
        "tenant_pseudonym": str(tenant_pseudonym(job.tenant_id)),
        "requested_by": job.requested_by,
        "requested_at": receipts.iso(job.requested_at),
        "started_at": receipts.iso(job.started_at),
        "completed_at": receipts.iso(now),
        "nodes": nodes,
        "bytes_freed": sum(n["freed_bytes"] for n in nodes),
        **facts,
    }


@transaction.atomic
def erasure_fail(*, job_id, reason: str) -> ErasureJob | None:
    """scheduled/running -> error with `reason` (a new request retries it). Anything else is unchanged."""
    job = _lock_job(job_id)
    if job is None or job.state not in (ErasureState.SCHEDULED, ErasureState.RUNNING):
        return job
    old_state = job.state
    job.state, job.error = ErasureState.ERROR, reason[:MAX_ERROR_LENGTH]
    job.save(update_fields=["state", "error", "updated_at"])
    _audit(
        AuditAction.ERASURE_FAILED,
        job,
        tenant_id=job.tenant_id,
        old={"state": old_state},
        new={"state": job.state, "error": job.error},
    )
    return job


def _guarded(step, job_id, **kwargs) -> ErasureJob | None:
    """Run one step; a failure rolls the step back and moves the job to `error` (audited) instead of raising."""
    try:
        return step(job_id=job_id, **kwargs)
    except Exception as error:
        logger.exception("erasure job %s failed in %s", job_id, step.__name__)
        return erasure_fail(job_id=job_id, reason=f"{step.__name__}: {type(error).__name__}: {error}")


def erasure_finish_guarded(*, job_id) -> ErasureJob | None:
    return _guarded(erasure_finish, job_id)


def erasures_run_due(*, now: datetime | None = None) -> list[str]:
    """Beat: start the scheduled jobs past their grace, finish running jobs with every purge confirmed (in case a
    finish message was lost), and resend purges unanswered for KCAAS_ERASURE_RESEND_SECONDS to live nodes.
    Returns the ids of the jobs it moved."""
    now = now or timezone.now()
    moved = []
    due = ErasureJob.objects.filter(state=ErasureState.SCHEDULED, scheduled_for__lte=now).order_by("scheduled_for")
    for job_id in list(due.values_list("id", flat=True)):
        job = _guarded(erasure_start, job_id, now=now)
        if job is not None and job.state != ErasureState.SCHEDULED:
            moved.append(str(job_id))
    ready = ErasureJob.objects.filter(state=ErasureState.RUNNING).exclude(purges__state=PurgeState.PENDING)
    for job_id in list(ready.values_list("id", flat=True)):
        job = erasure_finish_guarded(job_id=job_id)
        if job is not None and job.state != ErasureState.RUNNING:
            moved.append(str(job_id))
    _resend_stale_purges(now)
    return moved


@transaction.atomic
def _resend_stale_purges(now: datetime) -> int:
    stale_before = now - timedelta(seconds=settings.KCAAS_ERASURE_RESEND_SECONDS)
    purges = list(
        ErasurePurge.objects.select_for_update(of=("self",), skip_locked=True, no_key=True)
        .select_related("job")
        .filter(state=PurgeState.PENDING, job__state=ErasureState.RUNNING, last_sent_at__lt=stale_before)
    )
    return sum(_send_purges(purge.job, [purge], now) for purge in purges)
