"""The indexer with no engine registered waits for the next refresh: zmq's poll of no socket returns at once, and a
loop around it alone would hold a core on every `make up` (where no engine is registered at first)."""

import threading

import pytest

from routing.indexer import Indexer
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


class _Counting:
    """A zmq.Poller stand-in around the real one that counts its polls."""

    def __init__(self, poller):
        self.poller, self.polls = poller, 0

    def poll(self, timeout=None):
        self.polls += 1
        return self.poller.poll(timeout)

    def __getattr__(self, name):
        return getattr(self.poller, name)


def test_an_indexer_with_no_engine_waits_between_refreshes():
    indexer = Indexer(refresh_s=0.05, health_s=0.05, stale_s=2.0, cache_poll_s=0.05)
    refreshes = []
    real_refresh = indexer.refresh
    indexer.refresh = lambda: (refreshes.append(1), real_refresh())  # type: ignore[method-assign]
    indexer.poller = _Counting(indexer.poller)  # type: ignore[assignment]
    thread = threading.Thread(target=indexer.run, daemon=True)
    thread.start()
    try:
        assert eventually(lambda: len(refreshes) >= 5, timeout=30, interval=0.05)
    finally:
        indexer.stop.set()
        thread.join(timeout=30)
    assert indexer.poller.polls <= 2 * len(refreshes), (indexer.poller.polls, len(refreshes))
