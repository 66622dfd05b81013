"""Every console page answers both forms of its URL: the one without the trailing slash it has, or with one it
has not, is a permanent redirect to the canonical form (query kept; 308 for a form's POST, so it stays a POST);
an unknown URL is still the console's 404."""

import re
import uuid

import pytest
from django.urls import URLPattern, URLResolver

from console import urls as console_urls

pytestmark = pytest.mark.django_db
SOME_ID = str(uuid.uuid4())


def _pages(patterns, prefix: str = "/console/"):
    """The canonical path of every console route (a uuid where it takes one); the catch-all 404 left out."""
    for entry in patterns:
        route = str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _pages(entry.url_patterns, prefix + route)
        elif isinstance(entry, URLPattern) and not route.startswith("^"):
            yield prefix + re.sub(r"<uuid:\w+>", SOME_ID, route)


PAGES = sorted(set(_pages(console_urls.urlpatterns)))


def _other_form(path: str) -> str:
    return path[:-1] if path.endswith("/") else f"{path}/"


def test_the_routes_are_found_with_both_forms_among_them():
    assert "/console/" in PAGES and "/console/tenants/" in PAGES and "/console/login" in PAGES
    assert f"/console/nodes/{SOME_ID}/" in PAGES and "/console/audit/export" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_the_other_form_of_every_page_redirects_to_it(readonly_client, page):
    answer = readonly_client.get(_other_form(page) + "?a=1&b=2")
    assert answer.status_code == 301, (page, answer.status_code)
    assert answer["Location"] == f"{page}?a=1&b=2"


def test_a_post_to_the_other_form_stays_a_post(operator_client):
    page = f"/console/nodes/{SOME_ID}/cordon"
    answer = operator_client.post(_other_form(page))
    assert answer.status_code == 308 and answer["Location"] == page


def test_the_console_root_without_its_slash_redirects(readonly_client):
    answer = readonly_client.get("/console")
    assert answer.status_code in (301, 302) and answer["Location"].endswith("/console/")


def test_an_unknown_url_is_still_not_found_in_either_form(readonly_client):
    for path in ("/console/no-such-page", "/console/no-such-page/", "/console/nodes/not-a-uuid/"):
        answer = readonly_client.get(path)
        assert answer.status_code == 404 and b"There is no such console page" in answer.content, path
