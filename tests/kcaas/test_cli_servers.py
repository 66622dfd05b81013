"""The `kcaas` command line pointed at servers that are not the KCaaS API (tiny real servers on loopback, one per
kind): an HTML 404 page, text where JSON was due, a proxy's 502, JSON without the API's error envelope, a port that
hangs up, a TLS port spoken to in plain HTTP and a TLS port whose certificate is not trusted. Each ends in exit 3,
a one-line error naming the URL, a hint naming KCAAS_URL / --url, and no traceback."""

import datetime
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kcaas.cli import main

KEY = f"kc_live_{'A' * 12}_{'s' * 40}"
ANSWERS = {
    "html_404": (404, "text/html", b"<!DOCTYPE html><html><body><h1>404 Not Found</h1>\n<p>nope</p></body></html>"),
    "text_200": (200, "text/html", b"<html><body>Welcome to nginx!</body></html>"),
    "proxy_502": (502, "text/html", b"<html><head><title>502 Bad Gateway</title></head>\n<body></body></html>"),
    "json_404": (404, "application/json", b'{"detail": "Not found."}'),
    "empty_500": (500, "text/plain", b""),
}


def _answering(status: int, content_type: str, body: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args):  # keep the test output clean
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def serve():
    """serve(server) -> its http URL; started in a thread, shut down after the test."""
    started = []

    def start(server) -> str:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _Acceptor:
    """A loopback port that accepts connections and hands each to `handle(sock)` (which closes it)."""

    def __init__(self, handle) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.server_address = self.listener.getsockname()
        self._handle = handle
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._handle(conn)

    def shutdown(self) -> None:
        self._stopped.set()

    def server_close(self) -> None:
        self.listener.close()


def _hang_up(conn: socket.socket) -> None:
    conn.recv(65536)  # read the request, answer nothing


def _self_signed_context() -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_pem_files(cert, key))
    return context


def _pem_files(cert, key) -> tuple[str, str]:
    import tempfile

    folder = tempfile.mkdtemp(prefix="kcaas-cli-tls-")
    cert_path, key_path = f"{folder}/cert.pem", f"{folder}/key.pem"
    with open(cert_path, "wb") as handle:
        handle.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


def _tls_port(context: ssl.SSLContext) -> _Acceptor:
    def handshake(conn: socket.socket) -> None:
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(65536)
        except (ssl.SSLError, OSError):
            pass  # a plain-HTTP client, or one that refused the certificate

    return _Acceptor(handshake)


def _run(capsys, url: str, *argv: str) -> tuple[int, str, str]:
    code = main(["--url", url, "--api-key", KEY, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_unusable(code: int, out: str, err: str, url: str) -> list[str]:
    lines = err.splitlines()
    assert code == 3 and out == "", err
    assert len(lines) == 2 and lines[0].startswith("error: ") and url in lines[0], err
    assert lines[1].startswith("hint: ") and "KCAAS_URL" in lines[1] and "--url" in lines[1], err
    assert "Traceback" not in err and KEY not in err and "<" not in lines[0]
    return lines


@pytest.mark.parametrize("kind", sorted(ANSWERS))
@pytest.mark.parametrize("argv", [("ls",), ("show", "chat"), ("keys", "ls"), ("usage",)])
def test_a_server_that_is_not_the_api_is_named_with_a_hint(serve, capsys, kind, argv):
    url = serve(_answering(*ANSWERS[kind]))
    lines = _assert_unusable(*_run(capsys, url, *argv), url)
    assert lines[0].startswith("error: not_kcaas_api: ")
    if kind in ("proxy_502", "empty_500"):
        assert "gateway" in lines[1] and "make up" in lines[1]


def test_json_mode_reports_a_foreign_server_as_one_error_document(serve, capsys):
    url = serve(_answering(*ANSWERS["html_404"]))
    code, out, err = _run(capsys, url, "ls", "--json")
    error = json.loads(err)["error"]
    assert code == 3 and out == "" and error["code"] == "not_kcaas_api" and error["status"] == 404
    assert url in error["message"] and "KCAAS_URL" in error["hint"]


def test_a_port_that_hangs_up_is_a_connection_error_naming_the_url(serve, capsys):
    url = serve(_Acceptor(_hang_up))
    lines = _assert_unusable(*_run(capsys, url, "ls"), url)
    assert lines[0].startswith("error: connection_error: ") and "make up" in lines[1]


def test_a_tls_port_spoken_to_in_plain_http_suggests_https(serve, capsys):
    url = serve(_tls_port(_self_signed_context()))
    lines = _assert_unusable(*_run(capsys, url, "ls"), url)
    assert lines[0].startswith("error: connection_error: ") and "use an https:// URL" in lines[1]


def test_a_tls_port_with_an_untrusted_certificate_is_a_connection_error(serve, capsys):
    url = serve(_tls_port(_self_signed_context())).replace("http://", "https://")
    lines = _assert_unusable(*_run(capsys, url, "ls"), url)
    assert lines[0].startswith("error: connection_error: ") and "CERTIFICATE_VERIFY_FAILED" in lines[0]


def test_the_installed_entry_point_prints_no_traceback_for_an_html_page(serve, tmp_path):
    url = serve(_answering(*ANSWERS["html_404"]))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KCAAS_")},
        "KCAAS_URL": url,
        "KCAAS_API_KEY": KEY,
    }
    done = subprocess.run(
        [sys.executable, "-m", "kcaas", "show", "chat"], capture_output=True, text=True, timeout=60, env=env
    )
    _assert_unusable(done.returncode, done.stdout, done.stderr, url)


def test_help_names_the_environment_and_the_ttl_clamp(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "KCAAS_URL" in text and "KCAAS_API_KEY" in text and "clamps" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    assert main(["ls", "--help"]) == 0
    assert "--all" in capsys.readouterr().out


# ---- a reader that stops early (`kcaas ls | head -1`) ------------------------------------------------------------

_MANY_CACHES = json.dumps(
    [
        {"id": f"c{i:06d}" + "0" * 20, "name": f"cache-{i}", "state": "ready", "capacity": {"device": 2**30}}
        for i in range(3000)
    ]
).encode()  # a table far longer than a pipe's buffer (64 KiB)


def _env_for(url: str) -> dict:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KCAAS_")},
        "KCAAS_URL": url,
        "KCAAS_API_KEY": KEY,
    }


def _quiet_exit(code: int, stderr: str) -> None:
    assert code in (0, 141), stderr  # 141 = 128 + SIGPIPE, what a Unix tool cut off by `head` reports
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception ignored" not in stderr, stderr


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["--help"]])
def test_a_closed_stdout_ends_the_command_quietly(serve, argv):
    url = serve(_answering(200, "application/json", _MANY_CACHES))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KCAAS_")},
        "KCAAS_URL": url,
        "KCAAS_API_KEY": KEY,
    }
    reader, writer = os.pipe()
    os.close(reader)  # closed before the command writes: every write to stdout fails with EPIPE
    with os.fdopen(writer, "wb") as stdout:
        done = subprocess.run(
            [sys.executable, "-m", "kcaas", *argv],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=env,
        )
    _quiet_exit(done.returncode, done.stderr)


def test_piped_to_head_the_list_prints_its_first_line_and_no_traceback(serve):
    url = serve(_answering(200, "application/json", _MANY_CACHES))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KCAAS_")},
        "KCAAS_URL": url,
        "KCAAS_API_KEY": KEY,
    }
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"'{sys.executable}' -m kcaas ls --wide | head -1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.stdout.split() == ["ID", "NAME", "STATE", "ENDPOINT", "DEVICE", "DRAM", "SSD", "NETWORK", "CREATED"]
    _quiet_exit(done.returncode, done.stderr)
