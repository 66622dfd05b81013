"""Celery tasks of the tenants app (control queue). They take ids (or nothing) and are safe to rerun."""

from celery import shared_task

from tenants import services


@shared_task(name="tenants.flush_key_usage", acks_late=True)
def flush_key_usage() -> int:
    """Move key usage counters from Redis to PostgreSQL (beat, every 30 s). Idempotent: see tenants.usage."""
    return services.api_key_usage_flush()
