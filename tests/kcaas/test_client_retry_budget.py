"""kcaas.Client's retry schedule with default settings, against a real local HTTP server (the scripted one of
test_client_transport.py): it rides out an outage of about ten seconds (503s with Retry-After, or a server that
refuses connections until it is back), gives up once its retry budget is spent, keeps one Idempotency-Key across an
attach's attempts, and never repeats a non-idempotent POST the server may have acted on.

Time is the client's own: `_sleep` records each wait and moves the fake `_clock` forward by it, so the schedule is
checked exactly and the tests take milliseconds."""

import threading
from http.server import ThreadingHTTPServer

import pytest

import kcaas
from kcaas import errors
from tests.faults import free_port
from tests.kcaas.test_client_transport import RAW_KEY, WHOAMI, Scripted, _err, server  # noqa: F401

UNAVAILABLE = (503, {"Retry-After": "2"}, _err("database_unavailable", "The database is unavailable; retry later."))
OUTAGE_SECONDS = 10.0


class FakeTime:
    """The client's clock and sleep: sleeping advances the clock; `on_sleep(now)` runs after each wait."""

    def __init__(self, client: kcaas.Client, on_sleep=None):
        self.now, self.slept, self.on_sleep = 1000.0, [], on_sleep
        client._clock = lambda: self.now
        client._sleep = self.sleep

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(self.now - 1000.0)


def _client(port: int) -> kcaas.Client:
    return kcaas.Client(f"http://127.0.0.1:{port}", RAW_KEY)  # default retry settings throughout


def test_defaults_ride_out_ten_seconds_of_503_database_unavailable(server):
    Scripted.script = [UNAVAILABLE] * 5 + [(200, {}, WHOAMI)]  # 5 answers x Retry-After 2 s: a 10 s outage
    client = _client(server.server_address[1])
    clock = FakeTime(client)
    assert client.whoami().kind == "tenant_key"
    assert len(Scripted.seen) == 6 and len(clock.slept) == 5
    assert all(2.0 <= s <= 2.1 for s in clock.slept) and sum(clock.slept) >= OUTAGE_SECONDS  # as the server asked


def test_defaults_ride_out_a_server_that_refuses_connections_for_ten_seconds():
    """No answer at all (the control plane restarting): plain jittered backoff. Even if every wait drew its
    shortest value, the default schedule spans more than ten seconds before giving up."""
    port = free_port()
    servers = []

    def come_back(elapsed: float) -> None:
        if elapsed >= OUTAGE_SECONDS and not servers:
            Scripted.script, Scripted.seen, Scripted.peers = [(200, {}, WHOAMI)], [], []
            httpd = ThreadingHTTPServer(("127.0.0.1", port), Scripted)
            threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
            servers.append(httpd)

    client = _client(port)
    clock = FakeTime(client, on_sleep=come_back)
    try:
        assert client.whoami().kind == "tenant_key"
    finally:
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
    assert servers and len(Scripted.seen) == 1 and sum(clock.slept) >= OUTAGE_SECONDS
    assert max(clock.slept) <= client.backoff_max


def test_the_retry_budget_bounds_a_call_that_keeps_failing(server):
    Scripted.script = [UNAVAILABLE]
    client = _client(server.server_address[1])
    clock = FakeTime(client)
    with pytest.raises(errors.ServiceUnavailableError) as caught:
        client.get_cache("c1")
    assert caught.value.code == "database_unavailable"
    assert client.retry_budget - 2.1 < sum(clock.slept) <= client.retry_budget  # it used the budget, never more
    assert len(Scripted.seen) == len(clock.slept) + 1 <= client.retries + 1


def test_no_capacity_is_final_and_a_gateway_error_is_tried_a_few_times_not_for_the_whole_budget(server):
    """503 no_capacity (no node fits) is the API's own answer without a hint that it passes: raised at once, never
    retried (each retry was counted as another attach). A gateway's 503 (no API error code) gets a few tries."""
    Scripted.script = [(503, {}, _err("no_capacity", "No node fits."))]
    client = _client(server.server_address[1])
    clock = FakeTime(client)
    with pytest.raises(errors.ServiceUnavailableError) as caught:
        client.attach("n", {"x": 1}, {"device": 1}, wait=False)
    assert caught.value.code == "no_capacity"
    assert len(Scripted.seen) == 1 and clock.slept == []

    Scripted.script, Scripted.seen = [(503, {}, b"<html>upstream unavailable</html>")], []
    with pytest.raises(errors.ServiceUnavailableError) as caught:
        client.attach("n", {"x": 1}, {"device": 1}, wait=False)
    assert len(Scripted.seen) == 1 + kcaas.client.HINTLESS_RETRIES and sum(clock.slept) < 10


def test_the_shortest_schedule_still_spans_ten_seconds():
    """The property the defaults are chosen for: `retries` shortest waits (a tenth of each cap) exceed ten seconds,
    so the time budget, not the attempt count, is what ends a call during an outage."""
    client = kcaas.Client("http://127.0.0.1:1", RAW_KEY)
    caps = [min(client.backoff_max, client.backoff_base * 2**attempt) for attempt in range(client.retries)]
    assert sum(cap / 10 for cap in caps) > OUTAGE_SECONDS
    assert client.retry_budget >= 3 * OUTAGE_SECONDS


def test_attach_rides_out_an_outage_with_one_idempotency_key(server):
    cache = {"id": "c1", "name": "n", "state": "provisioning"}
    Scripted.script = [UNAVAILABLE] * 6 + [(409, {}, _err("idempotency_in_progress")), (201, {}, cache)]
    client = _client(server.server_address[1])
    FakeTime(client)
    assert client.attach("n", {"x": 1}, {"device": 1}, wait=False).id == "c1"
    keys = {headers["Idempotency-Key"] for method, _, headers in Scripted.seen if method == "POST"}
    assert len(Scripted.seen) == 8 and len(keys) == 1


class Dropping(Scripted):
    """Reads the request, then closes the connection without answering: a lost answer (the server may have acted)."""

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        type(self).seen.append((self.command, self.path, dict(self.headers)))
        self.close_connection = True

    do_GET = do_POST = do_DELETE = _answer


@pytest.fixture
def dropping():
    Dropping.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dropping)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_non_idempotent_post_is_never_repeated_after_the_server_may_have_acted(server, dropping):
    Scripted.script = [UNAVAILABLE]
    client = _client(server.server_address[1])
    FakeTime(client)
    with pytest.raises(errors.ServiceUnavailableError):
        client.issue_token("c1")
    assert len(Scripted.seen) == 1  # a 5xx: the view may have run

    lost = _client(dropping.server_address[1])
    clock = FakeTime(lost)
    with pytest.raises(errors.APIConnectionError) as caught:
        lost.create_key(["caches:read"])
    assert len(Dropping.seen) == 1 and not clock.slept and "not retried" in str(caught.value)
    with pytest.raises(errors.APIConnectionError):
        lost.get_key("k1")  # a GET may go again: it is, until the budget is spent
    assert len(Dropping.seen) > 2 and sum(clock.slept) <= lost.retry_budget
