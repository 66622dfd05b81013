"""The WSGI entry point (gunicorn: controlplane.wsgi:application).

Work every worker would otherwise do on its first requests is done here, before it serves: the query-parameter
table and the API root's listing are built from the OpenAPI schema (core.query_parameters.warm,
controlplane.api_root.warm), so concurrent first requests on a
fresh worker neither wait for it nor race to build it. Nothing here touches the database: a worker starts while
PostgreSQL is down and answers 503s until it is back. Under gunicorn, its own refusals of requests it cannot parse
(414, 431, 400) are answered in the project's JSON error shape (controlplane.gunicorn_errors).
"""

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()

from controlplane import api_root, gunicorn_errors  # noqa: E402 - needs the apps loaded
from core import query_parameters  # noqa: E402

query_parameters.warm()
api_root.warm()
gunicorn_errors.install()
