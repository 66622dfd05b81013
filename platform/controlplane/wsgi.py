"""The WSGI entry point (gunicorn: controlplane.wsgi:application).

Work every worker would otherwise do on its first requests is done here, before it serves: the query-parameter
table is built from the OpenAPI schema (controlplane.query_parameters.warm), so concurrent first requests on a
fresh worker neither wait for it nor race to build it. Nothing here touches the database: a worker starts while
PostgreSQL is down and answers 503s until it is back.
"""

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()

from controlplane import query_parameters  # noqa: E402 - needs the apps get_wsgi_application() loaded

query_parameters.warm()
