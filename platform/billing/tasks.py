"""Beat tasks of the billing room (control queue). Idempotent: the rollup replaces the hours it covers, pruning
keeps what open hours need, invoice generation is unique per tenant and month."""

from celery import shared_task

from audit.context import SYSTEM, acting_as
from billing import invoices, services
from core.metrics import BILLING_LAST_ROLLUP


@shared_task(name="billing.rollup")
def rollup() -> int:
    """Every KCAAS_USAGE_ROLLUP_SECONDS: recompute the open ledger hours, then prune the samples they no longer
    need (in that order: a sample is pruned only once the hours it fed are frozen and rolled up)."""
    rows = services.ledger_rollup_open_hours()
    services.usage_samples_prune()
    BILLING_LAST_ROLLUP.set_to_current_time()
    return rows


@shared_task(name="billing.invoices")
def generate_invoices() -> int:
    """Hourly: refresh the drafts of the current and previous month, finalise those past their grace."""
    with acting_as(SYSTEM):
        return invoices.invoices_generate_due()
