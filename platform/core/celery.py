"""The Celery app of the control plane. Tasks for a node go to that node's own queue, `node.<id>`
(kcaas.node_protocol.messages.node_queue); the control plane's own tasks (lease sweeping, provisioning results, key
usage flushes) run on the `control` queue."""

import os

from celery import Celery

from core.metrics import connect_celery_signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("kcaas")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
connect_celery_signals()  # task outcomes by name (core.metrics)
