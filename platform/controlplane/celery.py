"""The Celery app of the control plane. Tasks for a node go to that node's own queue, `node.<id>`; the control
plane's own tasks (lease sweeping, provisioning results, key usage flushes) run on the `control` queue."""

import os

from celery import Celery

from kcaas.node_messages import node_queue  # noqa: F401  re-exported: the rooms import it from here

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("kcaas")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

