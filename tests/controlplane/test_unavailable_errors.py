"""An outage of a backing service is a 503 with Retry-After in the one error shape, never a 500: in DRF views (the
exception handler) and outside them (middleware and plain views reach handler500). Real PostgreSQL cuts the
connection (pg_terminate_backend, as a restart does), real Redis/kombu clients find nobody listening. Genuine bugs
stay 500 `internal_error`."""

import logging

import psycopg
import pytest
from django import db
from django.contrib.auth.models import Group
from django.db import connection
from django.test import Client

from controlplane import urls
from core import errors
from tests.controlplane.outage_urls import PROBE_GROUP
from tests.waiting import eventually


@pytest.fixture
def outage_urls(settings):
    settings.ROOT_URLCONF = "tests.controlplane.outage_urls"


@pytest.fixture
def client():
    return Client(raise_request_exception=False)  # answer as the server would, also for what reaches handler500


@pytest.fixture
def cut_connection(transactional_db):
    """After the test, drop whatever is left of a connection the server cut, so teardown reconnects."""
    yield
    connection.close()


def assert_unavailable(response, code: str) -> None:
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == str(errors.RETRY_AFTER_SECONDS)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code and "retry" in body["error"]["message"].lower()


def assert_internal_error(response) -> None:
    assert response.status_code == 500, response.content
    assert response.json()["error"]["code"] == "internal_error" and not response.has_header("Retry-After")


def test_a_connection_cut_inside_a_drf_views_atomic_block_is_a_503_and_nothing_is_kept(
    outage_urls, client, cut_connection, caplog
):
    with caplog.at_level(logging.WARNING, logger="kcaas.errors"):
        assert_unavailable(client.get("/outage/cut-inside-atomic"), "database_unavailable")
    assert any(
        "database_unavailable" in r.getMessage() and "OperationalError" in r.getMessage() for r in caplog.records
    )  # the cause is logged
    connection.close()
    assert not Group.objects.filter(name=PROBE_GROUP).exists()  # the write was rolled back with its block


def test_redis_and_broker_connection_errors_in_drf_views_are_503_broker_unavailable(outage_urls, client):
    assert_unavailable(client.get("/outage/redis-down"), "broker_unavailable")
    assert_unavailable(client.get("/outage/broker-down"), "broker_unavailable")


def test_genuine_bugs_stay_500_internal_error(outage_urls, client, transactional_db):
    assert_internal_error(client.get("/outage/bug"))  # a ProgrammingError is a bug, not an outage
    assert_internal_error(client.get("/outage/plain-bug"))  # outside DRF too


def test_a_connection_cut_in_a_plain_django_view_is_a_503(outage_urls, client, cut_connection):
    assert_unavailable(client.get("/outage/plain-cut"), "database_unavailable")


def _terminate(pid: int) -> None:
    """Cut backend `pid` from another session and wait until it is gone."""
    params = connection.get_connection_params()
    conninfo = {k: params[k] for k in ("host", "port", "user", "password", "dbname") if params.get(k)}
    with psycopg.connect(**conninfo, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])

        def gone() -> bool:
            return other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[0] == 0

        assert eventually(gone, timeout=10), "the backend did not go away"


def test_a_database_outage_met_by_middleware_is_a_503(client, cut_connection, settings):
    """/console/ with a session cookie: ConsoleSessionMiddleware loads the session before any view runs. The
    project's own URLconf and handler500 answer."""
    assert urls.handler500 is errors.json_500
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    _terminate(pid)  # the persistent connection the next request will use is dead, as after a restart
    client.cookies[settings.SESSION_COOKIE_NAME] = "a" * 32
    assert_unavailable(client.get("/console/"), "database_unavailable")


@pytest.mark.parametrize(
    "exc, code",
    [
        (db.OperationalError("database is locked"), "database_unavailable"),  # SQLite's
        (db.InterfaceError("connection already closed"), "database_unavailable"),
        (db.ProgrammingError("relation does not exist"), None),
        (ValueError("a bug"), None),
        (None, None),
    ],
)
def test_which_errors_are_outages(exc, code):
    assert errors.unavailable_code(exc) == code


def test_an_error_raised_from_an_outage_is_an_outage():
    try:
        try:
            raise db.OperationalError("server closed the connection unexpectedly")
        except db.OperationalError as cause:
            raise RuntimeError("could not load the session") from cause
    except RuntimeError as wrapped:
        assert errors.unavailable_code(wrapped) == "database_unavailable"
    try:
        try:
            raise db.OperationalError("gone")
        except db.OperationalError:
            raise KeyError("a bug while handling it")  # noqa: B904 - implicit context only: still a bug
    except KeyError as bug:
        assert errors.unavailable_code(bug) is None
