"""The KCaaS control plane project: settings, URLs, the Celery app, errors."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
