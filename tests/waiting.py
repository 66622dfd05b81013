"""Waiting for what another process or thread does (a Celery worker, a node agent, a server thread): poll a
predicate until it holds or a deadline passes. Callers assert the result, so a timeout fails the test."""

import time


def eventually(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
