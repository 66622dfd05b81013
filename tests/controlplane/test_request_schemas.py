"""Every request body takes what the published schema says: where the schema says integer, a JSON integer only ("2",
2.0 and true are refused with a 400 naming the field), checked here for every operation of every room at once, so a
field added later with DRF's coercing IntegerField fails this test; and the schema's additionalProperties: false is
exactly where the validators refuse undeclared properties."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client
from drf_spectacular.generators import SchemaGenerator
from rest_framework import serializers

from core.openapi import RejectUnknownFieldsMixin
from fleet import services as fleet_services
from tenants.fields import StrictIntegerField

BODY_METHODS = ("POST", "PUT", "PATCH")


def _request_serializers() -> list[tuple[str, serializers.Serializer]]:
    generator = SchemaGenerator()
    generator._initialise_endpoints()
    found = []
    for path, _regex, method, callback in generator.endpoints:
        if method not in BODY_METHODS:
            continue
        view = generator.create_view(callback, method)
        serializer = view.schema.get_request_serializer()
        if serializer is not None:
            found.append((f"{method} {path}", serializer() if isinstance(serializer, type) else serializer))
    return found


def _fields(serializer, prefix=""):
    """(dotted name, field) for every writable field, nested serializers and list children included."""
    if isinstance(serializer, serializers.ListSerializer):
        yield from _fields(serializer.child, prefix + "[]")
        return
    for name, field in serializer.fields.items():
        if field.read_only:
            continue
        dotted = f"{prefix}.{name}" if prefix else name
        yield dotted, field
        inner = field
        while isinstance(inner, serializers.ListField | serializers.DictField):
            inner, dotted = inner.child, dotted + "[]"
            yield dotted, inner
        if isinstance(inner, serializers.BaseSerializer):
            yield from _fields(inner, dotted)


def test_every_integer_in_every_request_body_is_a_strict_json_integer():
    operations = _request_serializers()
    assert len(operations) >= 12  # keys, tenants, quota, caches, tokens, nodes, usage, rates...
    coercing = [
        f"{op}: {name}"
        for op, serializer in operations
        for name, field in _fields(serializer)
        if isinstance(field, serializers.IntegerField) and not isinstance(field, StrictIntegerField)
    ]
    assert coercing == []


def _resolve(schema: dict, components: dict) -> dict:
    while True:
        if "$ref" in schema:
            schema = components[schema["$ref"].rsplit("/", 1)[1]]
        elif "allOf" in schema and len(schema["allOf"]) == 1:
            schema = schema["allOf"][0]
        else:
            return schema


def _pairs(serializer, schema: dict, components: dict, where: str):
    """(where, serializer, its object schema) for a request serializer and every serializer nested in it."""
    if isinstance(serializer, serializers.ListSerializer):
        yield from _pairs(serializer.child, _resolve(schema, components)["items"], components, where + "[]")
        return
    schema = _resolve(schema, components)
    yield where, serializer, schema
    for name, field in serializer.fields.items():
        if isinstance(field, serializers.BaseSerializer) and not field.read_only:
            yield from _pairs(field, schema["properties"][name], components, f"{where}.{name}")


def test_the_schema_says_additional_properties_false_exactly_where_they_are_refused():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]
    checked = refusing = 0
    for operation, serializer in _request_serializers():
        method, path = operation.split(" ", 1)
        body = schema["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        for where, nested, object_schema in _pairs(serializer, body, components, operation):
            refuses = isinstance(nested, RejectUnknownFieldsMixin)
            assert (object_schema.get("additionalProperties") is False) is refuses, where
            checked, refusing = checked + 1, refusing + refuses
    assert checked > refusing >= 8  # keys, rotation, tenants, quota, attach + spec + capacity, tokens, rates


@pytest.mark.parametrize("refused", ["1", 1.0, True])
def test_node_bodies_refuse_integers_that_are_not_json_integers(db, refused):
    credential = fleet_services.node_create(name=f"strict-{uuid.uuid4().hex[:6]}").credential
    client = Client(HTTP_AUTHORIZATION=f"Bearer {credential}")
    tiers = {"device": 2**30, "dram": 0, "ssd": 0}
    cases = [
        ("/api/v1/nodes/register", {"endpoint": "10.1.0.9:7000", "capacity": {**tiers, "dram": refused}}, ["capacity"]),
        (
            "/api/v1/nodes/heartbeat",
            {"capacity": tiers, "resident": [{"cache_id": str(uuid.uuid4()), "hit_tokens": refused}]},
            ["resident"],
        ),
        (
            "/api/v1/nodes/usage",
            {"boot_id": str(uuid.uuid4()), "sequence": refused, "sampled_at": "2026-01-01T00:00:00Z", "caches": []},
            ["sequence"],
        ),
    ]
    for path, body, fields in cases:
        response = client.post(path, body, content_type="application/json")
        assert response.status_code == 400, (path, response.content)
        error = response.json()["error"]
        assert error["code"] == "validation_error" and list(error["details"]["fields"]) == fields, (path, error)
