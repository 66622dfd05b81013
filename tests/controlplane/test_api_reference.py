"""The API reference is complete and honest: every operation has a summary, a description, a curl sample and
request/response examples; every example has the shape of the operation's schema (the serializers') and, checked by
calling the live API, of what it really answers; the signed and certified examples verify with the project's own
verifiers; and the reference names only the authentication schemes that the live API accepts."""

import base64
import datetime as dt
import hashlib
import uuid
from datetime import timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from audit.keys import public_jwk_of
from console import access
from tenants import services
from tenants.scopes import ALL_SCOPES
from tests.caches.conftest import (  # noqa: F401 - fixtures for the live examples
    BLOCK_BYTES,
    attach_body,
    fast_password_hasher,
    make_node,
    make_ready,
    make_tenant,
    staff_client,
)

HTTP_METHODS = {"get", "post", "put", "patch", "delete"}
ACCEPTED_SCHEMES = {"ApiKeyAuth", "basicAuth", "NodeCredential"}


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def test_every_operation_has_a_summary_and_a_description(schema):
    missing = [
        op["operationId"] for _, _, op in _operations(schema) if not op.get("summary") or not op.get("description")
    ]
    assert missing == []
    summaries = [op["summary"] for _, _, op in _operations(schema)]
    assert len(summaries) == len(set(summaries))  # Redoc's sidebar tells them apart


def test_every_operation_has_a_curl_sample_with_its_credentials(schema):
    for _path, method, operation in _operations(schema):
        samples = operation.get("x-codeSamples", [])
        assert [sample["label"] for sample in samples] == ["curl"], operation["operationId"]
        source = samples[0]["source"]
        assert source.startswith("curl ") and "$KCAAS_URL" in source and "{" not in source.split("\n")[0]
        schemes = {name for requirement in operation.get("security", []) for name in requirement}
        if schemes:
            assert "Authorization: Bearer" in source or "-u " in source, operation["operationId"]
        if method in {"post", "put", "patch"} and operation.get("requestBody"):
            assert "-d '" in source, operation["operationId"]


def test_every_operation_has_request_and_response_examples(schema):
    """Every operation, and so any added later: a JSON request body has an example, so has its success answer."""
    missing = []
    for _path, _method, operation in _operations(schema):
        body = operation.get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None and not body.get("examples"):
            missing.append((operation["operationId"], "request"))
        success = next(response for code, response in operation["responses"].items() if code.startswith("2"))
        content = success.get("content", {})
        if content and not any(media.get("examples") for media in content.values()):
            missing.append((operation["operationId"], "response"))
    assert missing == []


def test_the_key_example_is_a_well_formed_key(schema):
    from core.keys import is_well_formed

    for operation in (schema["paths"]["/api/v1/keys"]["post"], schema["paths"]["/api/v1/keys/{key_id}/rotate"]["post"]):
        issued = next(iter(operation["responses"]["201"]["content"]["application/json"]["examples"].values()))
        assert is_well_formed(issued["value"]["key"])


def test_the_schema_names_only_schemes_the_api_accepts(schema):
    assert set(schema["components"]["securitySchemes"]) == ACCEPTED_SCHEMES  # no session cookie
    for _, _, operation in _operations(schema):
        for requirement in operation.get("security", []):
            assert set(requirement) <= ACCEPTED_SCHEMES


def _staff_only_gets(schema):
    """Staff-only GET operations without path parameters: the schema names basicAuth alone."""
    for path, method, operation in _operations(schema):
        schemes = [name for requirement in operation.get("security", []) for name in requirement]
        if method == "get" and schemes == ["basicAuth"] and "{" not in path:
            yield path


@pytest.mark.django_db
def test_an_api_key_is_refused_where_the_schema_names_basic_alone(schema):
    tenant = services.tenant_create(name="reference-acme")
    key = services.api_key_issue(tenant=tenant, scopes=list(ALL_SCOPES))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key.raw_key}")
    paths = list(_staff_only_gets(schema))
    assert "/api/v1/admin/tenants" in paths
    for path in paths:
        assert client.get(path).status_code == 403, path
    assert client.get("/api/v1/caches").status_code == 200  # and accepted where the schema names it


@pytest.mark.django_db
def test_basic_works_for_an_administrator_and_the_console_session_is_refused(schema):
    admin = get_user_model().objects.create_user("reference-admin", password="pw-reference-1", is_staff=True)
    basic = "Basic " + base64.b64encode(b"reference-admin:pw-reference-1").decode()
    assert Client().get("/api/v1/admin/tenants", HTTP_AUTHORIZATION=basic).status_code == 200
    console = Client()
    console.force_login(admin)
    session = console.session
    session[access.SESSION_FLAG] = True  # what the console's sign-in sets: the only sessions this product issues
    session.save()
    for path in ("/api/v1/admin/tenants", "/api/v1/caches", "/api/v1/whoami"):
        assert console.get(path).status_code in (401, 403), path


# ---- every example has its operation's shape ------------------------------------------------------------------------


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        node = schema["components"]["schemas"][name]
    return node


def _shape_problems(schema: dict, node: dict, value, where: str, direction: str) -> list[str]:
    """Where `value` does not fit the OpenAPI schema `node`: types, formats, enums, and for an object with declared
    properties exactly the serializer's fields (every required one present, none it does not have)."""
    node = _resolve(schema, node)
    if value is None:
        return [] if node.get("nullable") or not node else [f"{where}: null where the schema allows none"]
    if "allOf" in node:
        return [p for part in node["allOf"] for p in _shape_problems(schema, part, value, where, direction)]
    for combinator in ("oneOf", "anyOf"):
        if combinator in node:
            outcomes = [_shape_problems(schema, part, value, where, direction) for part in node[combinator]]
            return [] if any(not outcome for outcome in outcomes) else outcomes[0]
    kind = node.get("type")
    if kind is None and "properties" in node:
        kind = "object"
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__} where an object is expected"]
        problems = []
        properties = node.get("properties")
        hidden = "writeOnly" if direction == "response" else "readOnly"
        if properties is not None:
            wanted = {name for name in node.get("required", []) if not properties.get(name, {}).get(hidden)}
            problems += [f"{where}: missing {name}" for name in sorted(wanted - set(value))]
            if not node.get("additionalProperties"):
                problems += [
                    f"{where}: {name} is no field of the schema" for name in sorted(set(value) - set(properties))
                ]
            for name, item in value.items():
                if name in properties:
                    problems += _shape_problems(schema, properties[name], item, f"{where}.{name}", direction)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            for name, item in value.items():
                if properties is None or name not in properties:
                    problems += _shape_problems(schema, extra, item, f"{where}.{name}", direction)
        return problems
    if kind == "array":
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__} where an array is expected"]
        return [
            p
            for i, item in enumerate(value)
            for p in _shape_problems(schema, node["items"], item, f"{where}[{i}]", direction)
        ]
    if kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
        return [f"{where}: {value!r} is not an integer"]
    if kind == "number" and (not isinstance(value, int | float) or isinstance(value, bool)):
        return [f"{where}: {value!r} is not a number"]
    if kind == "boolean" and not isinstance(value, bool):
        return [f"{where}: {value!r} is not a boolean"]
    if kind == "string":
        if not isinstance(value, str):
            return [f"{where}: {value!r} is not a string"]
        try:
            if node.get("format") == "uuid":
                uuid.UUID(value)
            elif node.get("format") == "date-time":
                assert dt.datetime.fromisoformat(value).tzinfo is not None
        except (ValueError, AssertionError):
            return [f"{where}: {value!r} is not a {node['format']}"]
    if "enum" in node and value not in node["enum"]:
        return [f"{where}: {value!r} is not one of {node['enum']}"]
    return []


def _examples(schema):
    """(operation id, where, media schema, example value, direction) of every example in the reference."""
    for _path, _method, operation in _operations(schema):
        op = operation["operationId"]
        for media_type, media in operation.get("requestBody", {}).get("content", {}).items():
            for name, example in media.get("examples", {}).items():
                yield op, f"{op} request {media_type} {name}", media["schema"], example["value"], "request"
        for code, response in operation["responses"].items():
            for media_type, media in response.get("content", {}).items():
                for name, example in media.get("examples", {}).items():
                    yield op, f"{op} {code} {media_type} {name}", media["schema"], example["value"], "response"


def test_every_example_has_the_shape_of_its_schema(schema):
    problems, checked = [], set()
    for operation_id, where, media_schema, value, direction in _examples(schema):
        problems += _shape_problems(schema, media_schema, value, where, direction)
        checked.add(operation_id)
    assert problems == []
    with_bodies = {
        op["operationId"]
        for _, _, op in _operations(schema)
        if op.get("requestBody") or any(r.get("content") for c, r in op["responses"].items() if c.startswith("2"))
    }
    assert with_bodies <= checked


def test_the_shape_check_catches_a_missing_and_an_unknown_field(schema):
    node = {"$ref": "#/components/schemas/AuditDigest"}
    digest = _example(schema, "audit_digests_list", "200")["results"][0]
    assert _shape_problems(schema, node, digest, "d", "response") == []
    broken = {**{k: v for k, v in digest.items() if k != "signature"}, "sig": "x", "head_seq": "7"}
    assert _shape_problems(schema, node, broken, "d", "response") == [
        "d: missing signature",
        "d: sig is no field of the schema",
        "d.head_seq: '7' is not an integer",
    ]


def _example(schema, operation_id: str, code: str, index: int = 0, media_type: str = "application/json"):
    operation = next(op for _, _, op in _operations(schema) if op["operationId"] == operation_id)
    examples = operation["responses"][code]["content"][media_type]["examples"]
    return list(examples.values())[index]["value"]


# ---- the signed and certified examples verify ------------------------------------------------------------------------


def test_the_audit_examples_verify_under_the_example_platform_key():
    from audit import api_examples as ex
    from audit import chain

    assert ex.JWK["kid"] == chain.jwk_thumbprint(ex.JWK)
    example_key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(ex.EXAMPLE_KEY_LABEL.encode()).digest())
    assert public_jwk_of(example_key.public_key()) == ex.JWK == ex.PLATFORM_KEY.value
    for text in (ex.EXPORT_JSONL, ex.EXPORT_CSV):  # what `python audit/chain.py verify` checks
        report = chain.verify_export(text.splitlines(keepends=True), trusted_key_jwk=ex.JWK)
        assert [str(problem) for problem in report.problems] == []
    for digest in (ex.DIGEST_09, ex.DIGEST_10):
        fields = ("period_start", "period_end", "head_seq", "head_hash", "prev_digest_hash", "key_id")
        body = chain.digest_body(**{name: digest[name] for name in fields})
        assert chain.digest_hash(body) == digest["digest_hash"]
        assert chain.signature_valid(ex.JWK, chain.canonical(body), digest["signature"])
    assert ex.DIGEST_10["prev_digest_hash"] == ex.DIGEST_09["digest_hash"]
    assert (ex.DIGEST_10["head_seq"], ex.DIGEST_10["head_hash"]) == (ex.EVENT_READY["seq"], ex.EVENT_READY["hash"])
    listed = ex.EVENT_LIST.value
    assert (listed["seq"], listed["hash"]) == (ex.EVENT_ATTACHED["seq"], ex.EVENT_ATTACHED["hash"])


def test_the_erasure_receipt_example_verifies_under_the_example_platform_key():
    from audit import api_examples as audit_examples
    from privacy import api_examples as ex
    from privacy.receipt_verify import verify

    receipt = verify(ex.ERASURE_RECEIPT.value, audit_examples.JWK)
    job = ex.JOB_COMPLETE
    assert (receipt["job_id"], receipt["tenant_id"]) == (job["id"], job["tenant_id"])
    assert receipt["bytes_freed"] == sum(purge["freed_bytes"] for purge in job["purges"])
    assert {node["node_id"] for node in receipt["nodes"]} == {purge["node_id"] for purge in job["purges"]}
    archive_keys = {key["public_id"] for key in ex.ARCHIVE["api_keys"]}
    assert {key["public_id"] for key in receipt["api_keys_revoked"]} == archive_keys


def test_the_node_certificate_examples_are_issued_by_the_example_ca_for_the_csr_key():
    from fleet import api_examples as ex
    from fleet import pki
    from kcaas.node_protocol.sealing import public_key_bytes

    ca = x509.load_pem_x509_certificate(ex.CA_PEM.encode())
    ca_key = ec.derive_private_key(
        int.from_bytes(hashlib.sha256(ex.EXAMPLE_CA_LABEL.encode()).digest()), ec.SECP256R1()
    )
    assert pki._ca_certificate(ca_key) == ca  # what the platform makes of that key
    node_key = ec.derive_private_key(
        int.from_bytes(hashlib.sha256(ex.EXAMPLE_NODE_KEY_LABEL.encode()).digest()), ec.SECP256R1()
    )
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == pki.CA_COMMON_NAME
    assert ex.PLATFORM_CA.value == ex.CA_PEM == ex.REGISTERED.value["ca_certificate"]
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    for csr_pem, cert_pem, issued_at in (
        (ex.CSR_PEM, ex.REGISTERED.value["certificate"], ex.RESTARTED_AT),
        (ex.RENEWAL_CSR_PEM, ex.RENEWED.value["certificate"], "2026-03-02T20:30:00Z"),
    ):
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        cert.verify_directly_issued_by(ca)
        assert cert.public_key() == node_key.public_key()
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().public_bytes(serialization.Encoding.DER, raw) == pki.csr_public_key(
            csr_pem
        ).public_bytes(serialization.Encoding.DER, raw)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.UniformResourceIdentifier) == [pki.SPIFFE_NODE_PREFIX + ex.NODE_ID]
        assert names.get_values_for_type(x509.DNSName) == [str(ex.NODE["endpoint"]).rpartition(":")[0]]
        issued = dt.datetime.fromisoformat(issued_at)
        assert cert.not_valid_before_utc == issued - pki.BACKDATE
        assert cert.not_valid_after_utc == issued + timedelta(hours=12)  # KCAAS_NODE_CERT_HOURS' default
    assert len(public_key_bytes(ex.SEALING_PUBLIC_KEY)) == 32
    assert ex.REGISTER_REQUEST.value["endpoint"] == ex.NODE["endpoint"]


# ---- the examples have the shape of what the live API answers -------------------------------------------------------


FREE_FORM = {"old_values", "new_values"}  # an audit event's values: each action has its own


def _same_shape(example, real, where: str) -> list[str]:
    """Where the example's structure differs from a real answer's: the same keys in every object, lists of items of
    the same shape (item by item when both are as long, else each like the answer's first), the same JSON types (null
    matches anything: a real answer's absent timestamp, an example's)."""
    if example is None or real is None:
        return []
    if isinstance(example, dict) and isinstance(real, dict):
        problems = []
        if set(example) != set(real):
            problems.append(f"{where}: {sorted(set(example) ^ set(real))} in only one of them")
        for key in sorted(set(example) & set(real) - FREE_FORM):
            problems += _same_shape(example[key], real[key], f"{where}.{key}")
        return problems
    if isinstance(example, list) and isinstance(real, list):
        if not example or not real:
            return []
        pairs = zip(example, real) if len(example) == len(real) else ((item, real[0]) for item in example)
        return [problem for item, answer in pairs for problem in _same_shape(item, answer, f"{where}[]")]
    if type(example) is not type(real):
        return [f"{where}: {type(example).__name__} in the example, {type(real).__name__} in the answer"]
    return []


def _csr(*, forged: bool = False) -> str:
    """A CSR for a fresh P-256 key; forged: its signature's last byte changed (not signed by its key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kcaas node")])
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    der = bytearray(request.public_bytes(serialization.Encoding.DER))
    if forged:
        der[-1] ^= 0x01
    return x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()


@pytest.mark.django_db
def test_the_examples_have_the_shape_of_the_live_answers(schema, staff_client, make_tenant, make_node, settings):
    """Each of these operations called for real: its examples' keys, nesting and types are those of the answer."""
    from audit.digests import audit_digest_sign
    from billing.selectors import UsageBucket
    from fleet import services as fleet_services
    from fleet.models import Node
    from privacy import api_examples as privacy_examples
    from privacy import services as privacy_services
    from privacy.models import ErasureJob
    from tests.fleet.node_keys import TEST_SEALING_PUBLIC_KEY

    settings.KCAAS_ERASURE_GRACE_SECONDS = 0
    answers: list[tuple[str, str, int, object]] = []  # (operation id, code, example index, answer)

    def called(operation_id: str, response, code: int, index: int = 0):
        assert response.status_code == code, (operation_id, response.content)
        answers.append((operation_id, str(code), index, response.json()))
        return response.json()

    acme = make_tenant(scopes=list(ALL_SCOPES))
    issued = fleet_services.node_create(name=f"node-{uuid.uuid4().hex[:6]}")
    host = APIClient()
    host.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    capacity = {"device": 64 * 2**30, "dram": 512 * 2**30, "ssd": 4096 * 2**30}
    first = {"endpoint": "10.2.0.7:7443", "capacity": capacity, "sealing_public_key": TEST_SEALING_PUBLIC_KEY}
    assert host.post("/api/v1/nodes/register", first, format="json").status_code == 200
    attached = acme.client.post("/api/v1/caches", attach_body("c1", device=8 * BLOCK_BYTES), format="json")
    cache = make_ready(attached.json()["id"])  # on the one node there is
    node_id = issued.node.pk
    assert cache.node_id == node_id
    token = acme.client.post(
        f"/api/v1/caches/{cache.pk}/tokens", {"access": "readwrite", "ttl_seconds": 600}, format="json"
    )
    acme.client.post(f"/api/v1/caches/{cache.pk}/tokens/{token.json()['jti']}/revoke")
    other = make_node(device=64 * 2**30)  # where a drain moves the cache
    register = {**first, "caches": [str(cache.pk)], "csr": _csr()}
    called("nodes_register", host.post("/api/v1/nodes/register", register, format="json"), 200)
    beat = {
        "capacity": capacity,
        "resident": [{"cache_id": str(cache.pk), "device_bytes": 4096, "hit_tokens": 3, "miss_tokens": 1}],
    }
    called("nodes_heartbeat", host.post("/api/v1/nodes/heartbeat", beat, format="json"), 200)
    called("nodes_certificate_renew", host.post("/api/v1/nodes/certificate", {"csr": _csr()}, format="json"), 200)
    called(
        "nodes_certificate_renew",
        host.post("/api/v1/nodes/certificate", {"csr": _csr(forged=True)}, format="json"),
        400,
    )
    entry = {"cache_id": str(cache.pk), "device_bytes": 4096, "dram_bytes": 0, "ssd_bytes": 0, "network_bytes": 0}
    report = {
        "boot_id": str(uuid.uuid4()),
        "sequence": 1,
        "sampled_at": timezone.now().replace(microsecond=0).isoformat(),
        "caches": [{**entry, "bytes_written_total": 8192, "tokens_served_total": 64}],
    }
    called("nodes_usage", host.post("/api/v1/nodes/usage", report, format="json"), 200)
    future = {**report, "sequence": 2, "sampled_at": (timezone.now() + timedelta(hours=1)).isoformat()}
    called("nodes_usage", host.post("/api/v1/nodes/usage", future, format="json"), 400)

    called("audit_events_list", staff_client.get("/api/v1/audit/events?limit=2"), 200)
    called("audit_events_list", acme.key("caches:read").get("/api/v1/audit/events"), 403)
    audit_digest_sign(now=timezone.now() + timedelta(hours=2))
    called("audit_digests_list", staff_client.get("/api/v1/audit/digests?limit=2"), 200)
    called(
        "audit_digests_list",
        staff_client.get("/api/v1/audit/digests?from=2026-03-02T11:00:00Z&to=2026-03-02T10:00:00Z"),
        400,
    )
    called("export_retrieve", acme.client.get("/api/v1/export"), 200)
    called("export_retrieve", acme.key("caches:read").get("/api/v1/export"), 403)
    called("admin_tenant_export_retrieve", staff_client.get(f"/api/v1/admin/tenants/{acme.tenant.pk}/export"), 200)
    called("admin_tenant_export_retrieve", staff_client.get(f"/api/v1/admin/tenants/{uuid.uuid4()}/export"), 404)

    called("admin_nodes_drain", staff_client.post(f"/api/v1/admin/nodes/{node_id}/drain"), 200)
    called("admin_nodes_drain", staff_client.post(f"/api/v1/admin/nodes/{uuid.uuid4()}/drain"), 404)
    Node.objects.filter(pk=other.pk).update(state="lost")
    called("admin_nodes_drain", staff_client.post(f"/api/v1/admin/nodes/{other.pk}/drain"), 409)

    settings.KCAAS_ERASURE_GRACE_SECONDS = 86400
    bystander = make_tenant()
    erasure = f"/api/v1/admin/tenants/{bystander.tenant.pk}/erasure"
    called("admin_tenant_erasure_request", staff_client.post(erasure), 201)
    called("admin_tenant_erasure_request", staff_client.post(erasure), 200)
    called("admin_tenant_erasure_cancel", staff_client.post(f"{erasure}/cancel"), 200)
    called("admin_tenant_erasure_retrieve", staff_client.get(f"/api/v1/admin/tenants/{acme.tenant.pk}/erasure"), 404)
    settings.KCAAS_ERASURE_GRACE_SECONDS = 0
    erasure = f"/api/v1/admin/tenants/{acme.tenant.pk}/erasure"
    called("admin_tenant_erasure_request", staff_client.post(erasure), 201)
    privacy_services.erasures_run_due()
    called("admin_tenant_erasure_retrieve", staff_client.get(erasure), 200)
    called("admin_tenant_erasure_cancel", staff_client.post(f"{erasure}/cancel"), 409)
    called("admin_tenant_erasure_receipt", staff_client.get(f"{erasure}/receipt"), 409)
    job = ErasureJob.objects.get(tenant_id=acme.tenant.pk)
    for purge in job.purges.all():
        freed = [{"cache_id": str(cache.pk), "freed_bytes": 4096}] if purge.node_id == node_id else []
        privacy_services.erasure_purge_confirmed(
            job_id=job.pk, node_id=purge.node_id, tenant_id=acme.tenant.pk, purged=freed
        )
    privacy_services.erasures_run_due()
    called("admin_tenant_erasure_retrieve", staff_client.get(erasure), 200, index=1)
    called("admin_tenant_erasure_receipt", staff_client.get(f"{erasure}/receipt"), 200)

    problems = []
    for operation_id, code, index, answer in answers:
        example = _example(schema, operation_id, code, index)
        problems += _same_shape(example, answer, f"{operation_id} {code}")
    assert problems == [], "\n".join(problems)
    bucket = UsageBucket(timezone.now(), dict.fromkeys(("device", "dram", "ssd", "network"), 0), 0, 0).as_dict()
    assert set(privacy_examples.ARCHIVE["billing"]["metered_usage"][0]) == set(bucket)  # the live archive has none
