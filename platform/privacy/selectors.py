"""Reads of the privacy room."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count, Q, QuerySet

from audit.services import tenant_pseudonym
from core.errors import ConflictError, NotFoundError
from core.ids import as_uuid
from privacy import receipt as receipts
from privacy.models import CANCELLABLE_STATES, ErasureJob, ErasureState, PurgeState
from tenants.models import Tenant


def erasure_job_for_tenant(*, tenant_id) -> ErasureJob:
    """The tenant's erasure job that is not cancelled, else its latest cancelled one; 404 when it has none."""
    wanted = as_uuid(tenant_id)
    jobs = ErasureJob.objects.filter(tenant_id=wanted).prefetch_related("purges") if wanted else None
    job = jobs.exclude(state=ErasureState.CANCELLED).first() or jobs.first() if jobs is not None else None
    if job is None:
        raise NotFoundError("No erasure job for this tenant.")
    return job


def erasures_not_started(*, tenant_ids: Iterable) -> dict:
    """{tenant id: its erasure job that has not started yet (pending or scheduled: inside the grace window, still
    cancellable)} for those of `tenant_ids` that have one (one query)."""
    wanted = {as_uuid(tenant_id) for tenant_id in tenant_ids} - {None}
    jobs = ErasureJob.objects.filter(tenant_id__in=wanted, state__in=CANCELLABLE_STATES)
    return {job.tenant_id: job for job in jobs}


def erasure_receipt_job(*, tenant_id) -> ErasureJob:
    """The completed job whose receipt to show; 409 `erasure_not_complete` before it completes."""
    job = erasure_job_for_tenant(tenant_id=tenant_id)
    if job.state != ErasureState.COMPLETE or job.receipt is None:
        raise ConflictError(
            f"The erasure is {job.state}; its receipt exists once it completes.",
            code="erasure_not_complete",
            details={"state": job.state},
        )
    return job


def erasure_job_list() -> QuerySet[ErasureJob]:
    """Every erasure job of every tenant, newest request first, each annotated with `nodes_to_purge` (its purge rows:
    one per node known when it started, 0 before) and `nodes_purged` (those confirmed)."""
    return ErasureJob.objects.annotate(
        nodes_to_purge=Count("purges"),
        nodes_purged=Count("purges", filter=Q(purges__state=PurgeState.CONFIRMED)),
    ).order_by("-requested_at", "-id")


def erasure_tenant_labels(*, tenant_ids: Iterable) -> dict:
    """{tenant id: how a page may name it}: the tenant's current name — an erased tenant's is already
    `erased-<pseudonym>` — or `erased-<pseudonym>` when its row is gone; never anything erasure removed."""
    wanted = {as_uuid(tenant_id) for tenant_id in tenant_ids} - {None}
    names = dict(Tenant.objects.filter(pk__in=wanted).values_list("pk", "name"))
    return {tenant_id: names.get(tenant_id) or f"erased-{tenant_pseudonym(tenant_id)}" for tenant_id in wanted}


def erasure_receipt_verifies(*, job: ErasureJob) -> bool:
    """Whether the job's stored receipt verifies under the platform's current key (False while it has none)."""
    if job.receipt is None:
        return False
    try:
        receipts.receipt_verify(receipts.receipt_envelope(job))
    except ValueError:
        return False
    return True
