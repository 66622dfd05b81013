"""DataPlaneClient.read_only tells a connector whether its token grants writes (so it can run decode-only)."""

import base64
import json
from types import SimpleNamespace

from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec

SPEC = KVCacheSpec(
    model_fingerprint="m@1",
    num_layers=1,
    num_kv_heads=1,
    head_dim=2,
    block_size=4,
    kv_dtype="float32",
    storage_dtype="float32",
)


def client(token) -> DataPlaneClient:
    return DataPlaneClient(uds_path="/nonexistent.sock", token=token, cache_id="c", identity=SPEC)


def raw_token(claims: dict) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"eyJhbGciOiJFZERTQSJ9.{body}.c2ln"


def test_a_read_token_makes_the_client_read_only():
    assert client(SimpleNamespace(access="read", get=lambda: None)).read_only
    assert client(raw_token({"access": "read", "aud": "cache:c"})).read_only


def test_a_readwrite_token_does_not():
    assert not client(SimpleNamespace(access="readwrite", get=lambda: None)).read_only
    assert not client(raw_token({"access": "readwrite"})).read_only
    assert not client("not-a-jwt").read_only  # unknown: the node decides, the client does not guess read-only
