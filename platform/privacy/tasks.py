"""Control-queue tasks of the privacy room. Each takes ids and calls one service; the services' status guards make
redelivery and duplicates no-ops. Nodes send privacy.purge_result (kcaas.node_protocol.messages); beat runs
privacy.run_erasures every KCAAS_ERASURE_TICK_SECONDS."""

from celery import shared_task

from audit.context import Actor, acting_as
from core.node_answers import node_answer_task
from kcaas.node_protocol.messages import PurgeResult
from privacy import services


@node_answer_task(PurgeResult)
def purge_result(answer: PurgeResult) -> str | None:
    """A node's answer to kcaas.node.purge_tenant: its pools of the tenant are gone, `purged` says which, with the
    bytes freed. Recorded as that node's act."""
    with acting_as(Actor("node", answer.node_id)):
        purge = services.erasure_purge_confirmed(
            job_id=answer.job_id, node_id=answer.node_id, tenant_id=answer.tenant_id, purged=answer.purged
        )
    return purge.state if purge is not None else None


@shared_task(name=services.FINISH_TASK)
def erasure_finish(job_id: str) -> str | None:
    """Complete a running job whose every purge is confirmed (a no-op otherwise); a failure moves it to error."""
    job = services.erasure_finish_guarded(job_id=job_id)
    return job.state if job is not None else None


@shared_task(name="privacy.run_erasures")
def run_erasures() -> int:
    """Beat: start jobs past their grace, finish confirmed ones, resend stale purges."""
    return len(services.erasures_run_due())
