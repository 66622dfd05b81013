"""The control plane's Celery app on a broker of the test's own (tests.faults.PrivateRedis), so a test can stop
the broker under it. `use_broker(url)` repoints the app (and drops its connection pools, which kombu fills lazily
from the configuration); leaving the context restores the configured broker."""

from __future__ import annotations

import contextlib

from controlplane.celery import app as control_app


def _reset_pools() -> None:
    if control_app._pool is not None:
        control_app._pool.force_close_all()
        control_app._pool = None
    control_app.amqp._producer_pool = None


@contextlib.contextmanager
def use_broker(url: str):
    names = ("broker_url", "broker_read_url", "broker_write_url")
    previous = {name: control_app.conf[name] for name in names}
    _reset_pools()
    control_app.conf.update({name: url for name in names})
    try:
        yield control_app
    finally:
        _reset_pools()
        control_app.conf.update(previous)
