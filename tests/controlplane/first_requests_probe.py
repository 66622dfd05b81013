"""Run as a fresh process (`python -m tests.controlplane.first_requests_probe MODE COUNT`): load the control plane's
WSGI application, fire COUNT concurrent first requests with query parameters through it, and print one JSON line:
{"warm_before_requests": bool, "statuses": [...]}.

MODE `wsgi` loads controlplane.wsgi (the gunicorn entry point); `lazy` calls get_wsgi_application() alone, so the
first requests themselves build the query-parameter table. Half the requests carry a documented parameter
(`limit`), half a typo (`limt`); none is authenticated, so none touches the database."""

from __future__ import annotations

import json
import os
import sys
import threading
from wsgiref.util import setup_testing_defaults


def load(mode: str):
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    if mode == "wsgi":
        from controlplane.wsgi import application
    else:
        from django.core.wsgi import get_wsgi_application

        application = get_wsgi_application()
    return application


def fire(application, count: int) -> list[int]:
    """COUNT requests released together by a barrier, each on its own thread; their HTTP statuses."""
    barrier = threading.Barrier(count)
    statuses: list[int] = []

    def one(index: int) -> None:
        environ: dict = {}
        setup_testing_defaults(environ)
        query = "limit=5" if index % 2 else "limt=5"
        environ.update(REQUEST_METHOD="GET", PATH_INFO="/api/v1/caches", QUERY_STRING=query, HTTP_HOST="127.0.0.1")
        started: list[str] = []
        barrier.wait()
        body = application(environ, lambda status, headers, exc_info=None: started.append(status))
        try:
            b"".join(body)
        finally:
            getattr(body, "close", lambda: None)()
        statuses.append(int(started[0].split()[0]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return statuses


def main(mode: str, count: int) -> None:
    application = load(mode)
    from core import query_parameters

    warm = getattr(query_parameters, "_table", None) is not None
    print(json.dumps({"warm_before_requests": warm, "statuses": fire(application, count)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
