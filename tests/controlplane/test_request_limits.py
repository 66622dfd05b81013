"""Requests too large or too deep are the client's fault, answered in the error shape and never a 500: in process,
over a real socket (pytest-django's live_server) and through gunicorn as `make up` runs it, whose own refusals
(414, 431, a malformed request) are JSON too (controlplane.gunicorn_errors)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from tests.faults import free_port, stop_process
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
FIFTY_MB = 50 * 2**20
DEEP = b"[" * 1000 + b"]" * 1000


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
    assert body["error"]["code"] == code, body
    return body["error"]


@pytest.fixture
def client(db):
    return Client(raise_request_exception=False)


def _post(client, path, body: bytes, content_type="application/json", **extra):
    return client.generic("POST", path, body, content_type=content_type, **extra)


# ---- in process ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/api/v1/keys", "/api/v1/caches", "/api/v1/admin/tenants", "/console/login", "/healthz"]
)
def test_a_50_mb_body_is_413_request_too_large_wherever_it_is_sent(client, path, settings):
    body = b'{"name": "' + b"x" * FIFTY_MB + b'"}'
    error = assert_error(_post(client, path, body), 413, "request_too_large")
    assert error["details"] == {"max_bytes": settings.KCAAS_MAX_REQUEST_BYTES}


def test_the_limit_is_the_setting_and_a_body_at_it_passes(client, settings):
    settings.KCAAS_MAX_REQUEST_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    at_limit = b'{"name": "' + b"x" * (1000 - 12) + b'"}'
    assert len(at_limit) == 1000
    assert _post(client, "/api/v1/keys", at_limit).status_code == 401  # read, then refused for its credentials
    assert_error(_post(client, "/api/v1/keys", at_limit + b" "), 413, "request_too_large")


def test_a_body_too_large_for_django_read_inside_a_view_is_413_not_500(client, settings):
    """Defence in depth: were the middleware's limit above Django's, the RequestDataTooBig a DRF view meets while
    parsing is still a 413 (it was a 500 internal_error)."""
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("ops-big", is_staff=True))
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    error = assert_error(
        _post(client, "/api/v1/admin/tenants", b'{"name": "' + b"x" * 200 + b'"}'), 413, "request_too_large"
    )
    assert error["details"] == {"max_bytes": 100}


def test_too_many_query_fields_is_a_400_in_the_error_shape(client):
    query = "&".join(f"f{i}=1" for i in range(1500))
    assert_error(client.get(f"/api/v1/admin/tenants?{query}"), 400, "too_many_fields")


@pytest.mark.parametrize(
    "body", [DEEP, b'{"a":' * 1000 + b"1" + b"}" * 1000, b'{"name": ' + b"[" * 33 + b"]" * 33 + b"}"]
)
def test_json_nested_too_deep_is_400_json_too_deep(client, body, settings):
    for path in ("/api/v1/keys", "/api/v1/caches", "/api/v1/nodes/heartbeat"):
        error = assert_error(_post(client, path, body), 400, "json_too_deep")
        assert error["details"] == {"max_depth": settings.KCAAS_MAX_JSON_DEPTH}


def test_json_at_the_depth_limit_and_brackets_inside_strings_pass_the_check(client, settings):
    at_limit = b"[" * settings.KCAAS_MAX_JSON_DEPTH + b"]" * settings.KCAAS_MAX_JSON_DEPTH
    assert _post(client, "/api/v1/keys", at_limit).status_code == 401  # not refused for its depth
    in_strings = json.dumps({"name": "[{" * 500, "scopes": ["[" * 40]}).encode()
    assert _post(client, "/api/v1/keys", in_strings).status_code == 401
    assert _post(client, "/api/v1/keys", b"[" * 40 + b"]" * 40, content_type="text/plain").status_code == 401


def test_json_depth_counts_structure_not_strings():
    from controlplane.middleware import json_depth

    assert json_depth(b"") == 0 and json_depth(b"1") == 0 and json_depth(b"{}") == 1
    assert json_depth(b'{"a": [1, {"b": [[]]}]}') == 5
    assert json_depth(b'["\\"[[[", "]]]\\\\", [{}]]') == 3  # escaped quotes and backslashes inside strings
    assert json_depth(DEEP) == 1000
    assert json_depth(b'"[[[[ unterminated') == 4  # malformed: never raises (the parser reports it)


def test_a_chunked_body_is_411_length_required(client):
    assert_error(_post(client, "/api/v1/keys", b"", HTTP_TRANSFER_ENCODING="chunked"), 411, "length_required")


@pytest.mark.parametrize("length", ["12x", "-5"])
def test_a_malformed_content_length_is_400(client, length):
    assert_error(_post(client, "/api/v1/keys", b"{}", CONTENT_LENGTH=length), 400, "malformed_request")


# ---- over a real socket ----------------------------------------------------------------------------------------------


def _raw(port: int, request: bytes, *, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send `request` as is (headers and as much body as given) and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunked(body)
    return int(lines[0].split()[1]), headers, body


def _expected_length(data: bytes) -> int:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return len(data) + 1
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
        if name.strip().lower() == b"transfer-encoding":
            return len(data) + (0 if body.endswith(b"0\r\n\r\n") else 1)
    return len(data) + 1


def _unchunked(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if not size:
            break
        out, body = out + body[:size], body[size + 2 :]
    return out


def _post_raw(port: int, body: bytes, *, length: int | None = None, path="/api/v1/keys") -> tuple[int, dict, dict]:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n"
    )
    status, headers, answer = _raw(port, head.encode() + body)
    return status, headers, json.loads(answer)


def _assert_shape(body: dict, code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}, body
    assert body["error"]["code"] == code, body


def test_over_a_socket_an_announced_50_mb_body_is_refused_before_it_is_read(live_server):
    port = int(live_server.url.rsplit(":", 1)[1])
    status, headers, body = _post_raw(port, b'{"name": "' + b"x" * 65536, length=FIFTY_MB)  # the rest never comes
    assert status == 413 and headers["content-type"] == "application/json"
    _assert_shape(body, "request_too_large")
    status, _, body = _post_raw(port, DEEP)
    assert status == 400
    _assert_shape(body, "json_too_deep")


# ---- through gunicorn ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gunicorn_port(tmp_path_factory):
    """gunicorn serving controlplane.wsgi as `make up` runs it (gthread). Every request here is refused before
    anything reads the database, so the server needs none of its own."""
    var = tmp_path_factory.mktemp("gunicorn-var")
    env = {
        **os.environ,
        "KCAAS_VAR_DIR": str(var),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
    }
    port = free_port()
    log = var / "gunicorn.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "controlplane.wsgi:application",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                "1",
                "--worker-class",
                "gthread",
                "--threads",
                "4",
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        assert eventually(lambda: _serving(port) or server.poll() is not None, timeout=60)
        assert server.poll() is None, log.read_text()[-3000:]
        yield port
    finally:
        stop_process(server, timeout=15)


def _serving(port: int) -> bool:
    try:
        return _raw(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")[0] == 200
    except OSError:
        return False


def test_through_gunicorn_a_50_mb_body_is_413_in_the_error_shape(gunicorn_port):
    requests = pytest.importorskip("requests")  # a client that reads the early answer while it still sends
    body = b'{"name": "' + b"x" * FIFTY_MB + b'"}'
    response = requests.post(
        f"http://127.0.0.1:{gunicorn_port}/api/v1/keys",
        data=body,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413
    _assert_shape(response.json(), "request_too_large")
    status, _, answer = _post_raw(gunicorn_port, b"{", length=FIFTY_MB)
    assert status == 413
    _assert_shape(answer, "request_too_large")


def test_through_gunicorn_json_nested_1000_deep_is_400(gunicorn_port):
    status, headers, body = _post_raw(gunicorn_port, DEEP)
    assert status == 400 and headers["content-type"] == "application/json"
    _assert_shape(body, "json_too_deep")


def test_through_gunicorn_a_chunked_body_is_411(gunicorn_port):
    request = (
        b"POST /api/v1/keys HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    status, _, body = _raw(gunicorn_port, request)
    assert status == 411
    _assert_shape(json.loads(body), "length_required")


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414, "request_line_too_long"),
        (
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"".join(b"X-H%d: 1\r\n" % i for i in range(150))
            + b"\r\n",
            431,
            "request_headers_too_large",
        ),
        (
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
            431,
            "request_headers_too_large",
        ),
        (b"NOT A REQUEST\r\n\r\n", 400, "malformed_request"),
    ],
    ids=["long-url", "many-headers", "huge-header", "garbage"],
)
def test_gunicorns_own_refusals_are_json_in_the_error_shape(gunicorn_port, request_bytes, status, code):
    answered, headers, body = _raw(gunicorn_port, request_bytes)
    assert answered == status
    assert headers["content-type"] == "application/json" and b"<html" not in body.lower()
    _assert_shape(json.loads(body), code)
