"""kcaas.Client's transport against a scripted stdlib HTTP server on a real socket (no Django): which answers are
retried, for which requests, how long it waits, and what an error carries. The control plane itself is exercised in
test_client_live.py."""

import json
import select
import threading
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import kcaas
from kcaas import errors
from kcaas.client import Cache, DataToken, _retry_after
from kcaas.tokens import TokenSource
from tests.waiting import eventually

RAW_KEY = "kc_live_CCCCCCCCCCCCCCCC_" + "q" * 43 + "CRC123"


class Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    script: list = []  # (status, headers, body) answered in order; the last one repeats
    seen: list = []  # (method, path, headers)
    peers: list = []  # the client's (host, port) per request: a new port is a new connection

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        type(self).seen.append((self.command, self.path, dict(self.headers)))
        type(self).peers.append(self.client_address)
        status, headers, body = self.script[min(len(self.seen), len(self.script)) - 1]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if "X-Then-Close" in headers:  # drop the keep-alive connection without saying so (an idle timeout)
            self.close_connection = True

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    """Says when it has closed a connection (after the handler's close_connection, or the client's close)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.closed_one = threading.Event()

    def shutdown_request(self, request):
        super().shutdown_request(request)  # shut down for writing, then closed
        self.closed_one.set()


def _readable(sock) -> bool:
    """The idle socket has something to read: here, the server's FIN (checked here, not with the client's helper)."""
    return bool(select.select([sock], [], [], 0)[0])


@pytest.fixture
def server():
    Scripted.script, Scripted.seen, Scripted.peers = [], [], []
    httpd = _Server(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _client(httpd, **options):
    client = kcaas.Client(f"http://127.0.0.1:{httpd.server_address[1]}/api/v1/", RAW_KEY, **options)
    client.slept = []
    client._sleep = client.slept.append
    return client


def _err(code, message="nope", details=None):
    return {"error": {"code": code, "message": message, "details": details or {}}}


WHOAMI = {"kind": "tenant_key", "tenant_id": "t", "key_id": "k", "scopes": ["caches:read"], "new_field": 1}


def test_get_is_retried_on_502_503_504_and_429_with_retry_after(server):
    Scripted.script = [
        (502, {}, b"<html>bad gateway</html>"),
        (503, {}, b"Service Unavailable"),
        (429, {"Retry-After": "2"}, _err("rate_limited")),
        (504, {}, b""),
        (200, {}, WHOAMI),
    ]
    client = _client(server, retries=4)
    me = client.whoami()
    assert me.kind == "tenant_key" and me.scopes == ("caches:read",)  # unknown fields ignored
    assert len(client.slept) == 4 and 2.0 <= client.slept[2] <= 2.1
    assert all(s <= client.backoff_base * 2**i for i, s in enumerate(client.slept) if i != 2)
    (m, path, headers), *_ = Scripted.seen
    assert (m, path) == ("GET", "/api/v1/whoami") and headers["User-Agent"] == f"kcaas-sdk/{kcaas.__version__}"


def test_retries_are_bounded_and_the_last_error_is_typed(server):
    answer = (503, {"X-Request-ID": "req-42", "Retry-After": "1"}, _err("database_unavailable", "Database down."))
    Scripted.script = [answer]
    client = _client(server, retries=2)
    with pytest.raises(errors.ServiceUnavailableError) as caught:
        client.get_cache("c1")
    assert len(Scripted.seen) == 3 and len(client.slept) == 2
    assert (caught.value.status, caught.value.code, caught.value.request_id) == (503, "database_unavailable", "req-42")
    assert "Database down." in str(caught.value) and "req-42" in str(caught.value)


def test_retry_after_is_capped(server):
    Scripted.script = [(429, {"Retry-After": "3600"}, _err("rate_limited")), (200, {}, WHOAMI)]
    client = _client(server, max_retry_after=5)
    client.whoami()
    assert 5 <= client.slept[0] <= 5.1


def test_non_idempotent_posts_are_not_retried_on_503_but_attach_is_with_one_key(server):
    Scripted.script = [(503, {}, _err("unavailable"))]
    client = _client(server, retries=3)
    with pytest.raises(errors.ServiceUnavailableError):
        client.issue_token("c1")
    assert len(Scripted.seen) == 1

    cache = {"id": "c1", "name": "n", "state": "provisioning", "spec": {"bogus": 1}, "future": True}
    Scripted.script, Scripted.seen = (
        [
            (503, {"Retry-After": "1"}, _err("unavailable")),
            (409, {}, _err("idempotency_in_progress")),
            (201, {}, cache),
        ],
        [],
    )
    made = client.attach("n", {"x": 1}, {"device": 1}, wait=False)
    assert made == Cache(id="c1", name="n", state="provisioning")  # an unknown layout parses as spec None
    keys = {headers["Idempotency-Key"] for _, _, headers in Scripted.seen}
    assert len(Scripted.seen) == 3 and len(keys) == 1


@pytest.mark.parametrize(
    "status, code, cls",
    [
        (400, "invalid_spec", errors.ValidationError),
        (422, "idempotency_key_reused", errors.ValidationError),
        (401, "api_key_expired", errors.AuthenticationError),
        (403, "permission_denied", errors.PermissionDeniedError),
        (403, "quota_exceeded", errors.QuotaExceededError),
        (404, "not_found", errors.NotFoundError),
        (409, "cache_not_ready", errors.ConflictError),
        (429, "rate_limited", errors.RateLimitedError),
        (500, "internal_error", errors.ServerError),
        (503, "no_capacity", errors.ServiceUnavailableError),
        (418, "teapot", errors.KcaasError),
    ],
)
def test_status_and_code_pick_the_error_class(server, status, code, cls):
    Scripted.script = [(status, {"Retry-After": "1"}, _err(code, details={"limit": "max_caches"}))]
    with pytest.raises(cls) as caught:
        _client(server, retries=0).get_cache("c1")
    assert type(caught.value) is cls and (caught.value.status, caught.value.code) == (status, code)
    assert caught.value.details == {"limit": "max_caches"}


def test_the_key_is_scrubbed_even_if_a_server_echoes_it(server):
    Scripted.script = [(401, {}, _err("invalid_api_key", f"bad key {RAW_KEY}", {"key": RAW_KEY, "x": ["q" * 43]}))]
    with pytest.raises(errors.AuthenticationError) as caught:
        _client(server, retries=0).whoami()
    for text in (str(caught.value), repr(caught.value)):
        assert RAW_KEY not in text and "q" * 43 not in text
    assert "kc_live_CCCCCCCCCCCCCCCC_***" in str(caught.value)


def test_retry_after_accepts_seconds_and_http_dates():
    assert _retry_after({"retry-after": "3"}) == 3.0
    when = datetime.now(UTC) + timedelta(seconds=30)
    assert 25 <= _retry_after({"retry-after": format_datetime(when, usegmt=True)}) <= 30
    assert _retry_after({"retry-after": "soon"}) is None and _retry_after({}) is None


class _FlakyIssuer:
    """Stands in for Client.issue_token: hands out tokens with a given lifetime, or fails when told to."""

    def __init__(self):
        self.issued, self.fail = 0, False

    def issue_token(self, cache_id, *, access, ttl_seconds):
        if self.fail:
            raise errors.ServiceUnavailableError("down", status=503)
        self.issued += 1
        payload = json.dumps({"iat": 1000, "exp": 1100}).encode()  # 100 s, whatever the local wall clock says
        import base64

        body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return DataToken(
            token=f"h.{body}.s{self.issued}",
            cache_id=cache_id,
            access=access,
            expires_at=datetime(1970, 1, 1, tzinfo=UTC),
            jti=str(self.issued),
        )


def test_token_source_keeps_a_valid_token_when_a_refresh_fails():
    issuer = _FlakyIssuer()
    source = TokenSource(issuer, "c1", access="read")
    now = [0.0]
    source._clock = lambda: now[0]
    assert source.get().jti == "1"
    now[0] = 85.0  # in the last 20%: refresh due, but the control plane is down
    issuer.fail = True
    assert source.get().jti == "1"
    now[0] = 101.0  # expired: the failure surfaces
    with pytest.raises(errors.ServiceUnavailableError):
        source.get()
    issuer.fail = False
    assert source.get().jti == "2"


def test_429_is_retried_even_for_a_non_idempotent_post(server):
    token = {"token": "a.b.c", "cache_id": "c1", "access": "read", "expires_at": "2030-01-01T00:00:00Z"}
    Scripted.script = [(429, {"Retry-After": "1"}, _err("rate_limited")), (201, {}, token)]
    client = _client(server)
    issued = client.issue_token("c1", access="read")
    assert issued.expires_at == datetime(2030, 1, 1, tzinfo=UTC) and len(Scripted.seen) == 2
    assert "a.b.c" not in repr(issued)


def test_an_idle_connection_the_server_dropped_is_replaced_before_a_post(server):
    issued = {"id": "k2", "key": "kc_live_X_y", "scopes": ["caches:read"], "public_id": "X"}
    Scripted.script = [(200, {"X-Then-Close": "1"}, WHOAMI), (201, {}, issued), (200, {}, WHOAMI), (200, {}, WHOAMI)]
    client = _client(server, retries=0)
    client.whoami()
    assert server.closed_one.wait(10), "the scripted server did not close the first connection within 10 s"
    pooled = client._local.conn.sock  # still in the client's pool: nothing told it the connection went away
    assert pooled is not None, "the client did not keep the first connection"
    assert eventually(lambda: _readable(pooled), timeout=10), "the server's close did not reach the client in 10 s"
    assert client.create_key(["caches:read"]).id == "k2"  # not retried: it must go out on a fresh connection
    client.whoami()
    client.whoami()
    ports = [port for _, port in Scripted.peers]
    assert ports[0] != ports[1] and ports[1] == ports[2] == ports[3]  # then one keep-alive connection again
