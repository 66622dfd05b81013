"""The API reference: every operation described and tagged by resource, the main resources first (Redoc opens on
caches, not on the JWKS), and both docs pages (Redoc, Swagger UI) served from the control plane's own assets."""

import re

import pytest
from django.test import Client

ALLOWED_TAGS = [
    "caches",
    "routing",
    "tokens",
    "keys",
    "usage",
    "invoices",
    "audit",
    "privacy",
    "admin",
    "nodes",
    "well-known",
]
EXTERNAL_URL = re.compile(r"""(?:https?:)?//(?!testserver[/:"'])[a-z0-9.-]+\.[a-z]{2,}""", re.IGNORECASE)
HTTP_METHODS = {"get", "post", "put", "patch", "delete"}


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield f"{method.upper()} {path}", operation


def test_every_operation_has_a_real_description(schema):
    undescribed = [name for name, op in _operations(schema) if len(op.get("description", "").strip()) < 40]
    assert undescribed == []
    assert len(list(_operations(schema))) >= 46


def test_every_operation_has_one_tag_from_the_resource_set(schema):
    tags = {name: op.get("tags") for name, op in _operations(schema)}
    wrong = {name: found for name, found in tags.items() if found is None or found not in [[t] for t in ALLOWED_TAGS]}
    assert wrong == {}
    assert {found[0] for found in tags.values()} == set(ALLOWED_TAGS)  # no declared tag without an operation


def test_tags_are_declared_main_resources_first(schema):
    declared = [tag["name"] for tag in schema["tags"]]
    assert declared == ALLOWED_TAGS
    assert all(tag.get("description") for tag in schema["tags"])
    assert declared[0] == "caches" and declared[-1] == "well-known"  # Redoc opens on caches, never on the JWKS


@pytest.mark.parametrize("page", ["/api/docs/", "/api/docs/swagger/"])
def test_the_docs_pages_reference_no_external_url(page):
    response = Client().get(page)
    assert response.status_code == 200
    html = response.content.decode()
    assert EXTERNAL_URL.findall(html) == []
    assert "fonts.googleapis" not in html and "cdn.jsdelivr" not in html
    assert "/static/drf_spectacular_sidecar/" in html  # the UI itself comes from the sidecar's static files


def test_swagger_ui_asks_no_outside_validator():
    html = Client().get("/api/docs/swagger/").content.decode()
    assert re.search(r'"validatorUrl":\s*null', html)  # else the bundle fetches a badge from validator.swagger.io
