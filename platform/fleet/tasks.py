"""Control-queue tasks of the fleet room: beat publishes the node-order outbox (fleet.outbox)."""

from celery import shared_task

from fleet.outbox import orders_dispatch
from fleet.samples import samples_prune


@shared_task(name="fleet.dispatch_orders", ignore_result=True)
def dispatch_orders() -> dict:
    """Beat, every KCAAS_ORDER_DISPATCH_SECONDS: publish the due orders to nodes (first sends that failed, and
    re-sends of orders whose answer has not arrived)."""
    return orders_dispatch()


@shared_task(name="fleet.prune_samples", ignore_result=True)
def prune_samples() -> int:
    """Beat, hourly: forget heartbeat samples older than KCAAS_SAMPLE_RETENTION_DAYS (fleet.samples)."""
    return samples_prune()
