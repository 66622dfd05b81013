"""Reads of the privacy room."""

from __future__ import annotations

from controlplane.errors import ConflictError, NotFoundError
from privacy.models import ErasureJob, ErasureState
from tenants.ids import as_uuid


def erasure_job_for_tenant(*, tenant_id) -> ErasureJob:
    """The tenant's erasure job that is not cancelled, else its latest cancelled one; 404 when it has none."""
    wanted = as_uuid(tenant_id)
    jobs = ErasureJob.objects.filter(tenant_id=wanted).prefetch_related("purges") if wanted else None
    job = jobs.exclude(state=ErasureState.CANCELLED).first() or jobs.first() if jobs is not None else None
    if job is None:
        raise NotFoundError("No erasure job for this tenant.")
    return job


def erasure_receipt_job(*, tenant_id) -> ErasureJob:
    """The completed job whose receipt to show; 409 `erasure_not_complete` before it completes."""
    job = erasure_job_for_tenant(tenant_id=tenant_id)
    if job.state != ErasureState.COMPLETE or job.receipt is None:
        raise ConflictError(f"The erasure is {job.state}; its receipt exists once it completes.",
                            code="erasure_not_complete", details={"state": job.state})  # fmt: skip
    return job
