"""Celery tasks of the audit room."""

from celery import shared_task

from audit.context import SYSTEM, acting_as
from audit.digests import audit_digest_sign


@shared_task(name="audit.sign_digests")
def sign_digests() -> int:
    """Beat, every few minutes: sign the periods that closed since the last run (idempotent). Acts as system."""
    with acting_as(SYSTEM):
        return len(audit_digest_sign())
