"""Fixtures shared by the control plane's schema tests."""

import pytest
from django.test import Client


@pytest.fixture(scope="module")
def schema():
    """The published OpenAPI schema, as JSON."""
    response = Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()
