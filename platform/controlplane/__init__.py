"""The roof of the control plane: settings, URLs, wsgi and the authentication wiring. It imports every room and no
room imports it. `celery -A controlplane` finds the Celery app (core.celery) here."""

from core.celery import app

celery_app = app

__all__ = ["app", "celery_app"]
