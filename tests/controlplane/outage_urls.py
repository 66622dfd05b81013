"""A URLconf for test_unavailable_errors.py: the project's own routes and error handlers, plus a few views that meet a
backing service's outage (or a genuine bug) for real: the database connection they use is cut by the server
(pg_terminate_backend), Redis and the broker are asked for on a port nobody listens on."""

from django.contrib.auth.models import Group
from django.db import connection, transaction
from django.http import JsonResponse
from django.urls import path
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane import urls as project_urls
from tests.faults import free_port

PROBE_GROUP = "outage-probe"


class Bare(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []


class CutInsideAtomic(Bare):
    """Writes a row, then the server cuts this connection, all inside one atomic block."""

    def get(self, request):
        with transaction.atomic():
            Group.objects.create(name=PROBE_GROUP)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return Response({"unreachable": True})


class RedisDown(Bare):
    def get(self, request):
        import redis

        redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=2).ping()
        return Response({"unreachable": True})


class BrokerDown(Bare):
    def get(self, request):
        from kombu import Connection

        with Connection(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=2) as broker:
            broker.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        return Response({"unreachable": True})


class Bug(Bare):
    def get(self, request):
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table_anywhere")  # a ProgrammingError: a bug, not an outage
        return Response({"unreachable": True})


def plain_bug(request):
    raise RuntimeError("a genuine bug outside DRF")


def plain_cut(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return JsonResponse({"unreachable": True})


urlpatterns = [
    path("outage/cut-inside-atomic", CutInsideAtomic.as_view()),
    path("outage/redis-down", RedisDown.as_view()),
    path("outage/broker-down", BrokerDown.as_view()),
    path("outage/bug", Bug.as_view()),
    path("outage/plain-bug", plain_bug),
    path("outage/plain-cut", plain_cut),
    *project_urls.urlpatterns,
]
handler400, handler403 = project_urls.handler400, project_urls.handler403
handler404, handler500 = project_urls.handler404, project_urls.handler500
