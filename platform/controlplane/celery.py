"""The Celery app of the control plane. Tasks for a node go to that node's own queue, `node.<id>`; the control
plane's own tasks (lease sweeping, provisioning results, key usage flushes) run on the `control` queue."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("kcaas")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def node_queue(node_id) -> str:
    return f"node.{node_id}"
