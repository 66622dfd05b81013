"""The control plane's Celery app on a broker of the test's own (tests.faults.PrivateRedis), so a test can stop
the broker under it. `use_broker(url)` repoints the app: it sets the broker settings and unsets the app's pool
references, so kombu makes pools for the private broker (its pools live in process-wide registries keyed by the
broker URL). Leaving the context closes and forgets the private broker's pools and puts the app's own references
back untouched, so later tests publish through them as before (closing those instead left every later publish of
the process failing with "Acquire on closed pool")."""

from __future__ import annotations

import contextlib

from kombu import pools
from kombu.utils.collections import eqhash

from core.celery import app as control_app

_NAMES = ("broker_url", "broker_read_url", "broker_write_url")


@contextlib.contextmanager
def use_broker(url: str):
    saved = {name: control_app.conf[name] for name in _NAMES}
    saved_pool, saved_producers = control_app._pool, control_app.amqp._producer_pool
    control_app._pool, control_app.amqp._producer_pool = None, None
    control_app.conf.update({name: url for name in _NAMES})
    private = control_app.connection_for_write()
    try:
        yield control_app
    finally:
        for registry in (pools.producers, pools.connections):
            pool = dict.get(registry, eqhash(private))
            if pool is not None:
                pool.force_close_all()
                del registry[private]
        control_app._pool, control_app.amqp._producer_pool = saved_pool, saved_producers
        control_app.conf.update(saved)
