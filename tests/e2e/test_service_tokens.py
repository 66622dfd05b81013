"""Hostile data tokens against the real service: the control plane (live server, PostgreSQL), a node agent PROCESS
serving TLS 1.3, and a hand-made wire client (tests.e2e.conftest.RawConnection) that sends what the SDK never would.

Tenants A and B each attach a cache on the agent; A puts 3 blocks of known KV. Then every case of HOSTILE_TOKENS
presents its token in a HELLO for A's cache, over real TLS, and must get:

- the documented refusal (docs/protocol.md, kcaas.wire.ErrorCode): `unauthenticated` for a bad signature or a
  token not signed with EdDSA, `token_expired` for an expired one, `not_found` for a valid token that does not open
  A's cache on this node (another tenant's cache, another node, an older epoch);
- exactly the bytes (code, message, frame) that the same token gets for a cache id that exists nowhere: the answer
  says nothing about A;
- no data for A on that connection afterwards: LOOKUP, GET and PUT naming A's cache are refused (`unauthenticated`,
  no session), no answer carries a payload, and the refused PUT does not change A's cache;
- A's own client still reads back exactly the bytes it put.

Adding a case: write `def <case>(scene: Scene) -> str` returning the token to present (it may act on the service
first, e.g. revoke a token through the API before returning it) and list it in HOSTILE_TOKENS with its expected
code; the loop in the test runs it like the others.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import jwt
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import kcaas
from caches import signing
from fleet import services as fleet_services
from kcaas import wire
from kcaas.dataplane import DataPlaneClient
from kcaas.spec import KVCacheSpec
from kcaas.tokens import TokenSource
from kcaas.wire import ErrorCode, Opcode
from tests.e2e.conftest import RawConnection, client_tls, error_of, random_kv, random_tokens, spec_for, tenant_key
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
PROMPT_TOKENS = 48  # 3 full blocks of 16


# ---- the scene -------------------------------------------------------------------------------------------------------


@dataclass
class Scene:
    """What a hostile-token case may use: both tenants' API clients and caches, the agent, A's data."""

    spec: KVCacheSpec
    endpoint: str
    client_a: kcaas.Client
    client_b: kcaas.Client
    cache_a: kcaas.client.Cache
    cache_b: kcaas.client.Cache
    pki: dict

    def issue_a(self) -> kcaas.client.DataToken:
        """A fresh, real readwrite data token for A's cache (through the REST API)."""
        return self.client_a.issue_token(self.cache_a.id, access="readwrite")

    def claims_a(self) -> dict:
        """The claims of a real token for A's cache, as the control plane made them."""
        claims = self.issue_a().claims()
        assert claims["aud"] == f"cache:{self.cache_a.id}" and claims["node"] == self.cache_a.node_id
        return claims


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def platform_signed(claims: dict) -> str:
    """Signed with the platform's real data-token key (the live server runs in this process: same settings)."""
    return jwt.encode(
        claims, signing.signing_key(), algorithm="EdDSA", headers={"kid": signing.public_jwk()["kid"], "typ": "JWT"}
    )


def ids(tokens: torch.Tensor):
    return tokens.to(torch.int32).numpy()


def unsigned_jwt(header: dict, claims: dict, signature: bytes) -> str:
    signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    return f"{signing_input}.{b64url(signature)}"


# ---- the hostile tokens ----------------------------------------------------------------------------------------------


def forged_by_another_key(scene: Scene) -> str:
    """The right claims, signed by an Ed25519 key the platform never had (and naming that key's own kid)."""
    impostor = Ed25519PrivateKey.generate()
    kid = signing.public_jwk_of(impostor.public_key())["kid"]
    return jwt.encode(scene.claims_a(), impostor, algorithm="EdDSA", headers={"kid": kid, "typ": "JWT"})


def forged_with_the_platform_kid(scene: Scene) -> str:
    impostor = Ed25519PrivateKey.generate()
    headers = {"kid": signing.public_jwk()["kid"], "typ": "JWT"}
    return jwt.encode(scene.claims_a(), impostor, algorithm="EdDSA", headers=headers)


def forged_without_kid(scene: Scene) -> str:
    return jwt.encode(scene.claims_a(), Ed25519PrivateKey.generate(), algorithm="EdDSA")


def alg_none(scene: Scene) -> str:
    return unsigned_jwt({"alg": "none", "typ": "JWT", "kid": signing.public_jwk()["kid"]}, scene.claims_a(), b"")


def hs256_keyed_with_the_public_key(scene: Scene) -> str:
    """The algorithm-confusion attack: HMAC-SHA256 whose secret is the platform's (public) verification key."""
    public_pem = (
        signing.signing_key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": signing.public_jwk()["kid"]}
    unsigned = unsigned_jwt(header, scene.claims_a(), b"").rstrip(".")
    return f"{unsigned}.{b64url(hmac.new(public_pem, unsigned.encode(), hashlib.sha256).digest())}"


def expired(scene: Scene) -> str:
    claims = scene.claims_a()
    now = int(time.time())
    claims.update(iat=now - 600, nbf=now - 600, exp=now - 300)  # far beyond the verifier's 5 s leeway
    return platform_signed(claims)


def tenant_b_token(scene: Scene) -> str:
    token = scene.client_b.issue_token(scene.cache_b.id, access="readwrite")
    assert token.claims()["aud"] == f"cache:{scene.cache_b.id}"
    return token.token


def for_another_node(scene: Scene) -> str:
    other = fleet_services.node_create(name=f"e2e-other-{uuid.uuid4().hex[:6]}").node
    return platform_signed({**scene.claims_a(), "node": str(other.pk)})


def for_an_older_epoch(scene: Scene) -> str:
    claims = scene.claims_a()
    assert claims["epoch"] >= 1
    return platform_signed({**claims, "epoch": claims["epoch"] - 1})


def tampered_payload_character(scene: Scene) -> str:
    """A real token of A's whose payload JSON has one character changed (the last digit of exp: a longer life),
    re-encoded, with the original header and signature."""
    header, payload, signature = scene.issue_a().token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    text = json.dumps(claims, separators=(",", ":"))
    exp = str(claims["exp"])
    tampered = text.replace(f'"exp":{exp}', f'"exp":{exp[:-1]}{(int(exp[-1]) + 1) % 10}')
    assert sum(a != b for a, b in zip(text, tampered)) == 1 and len(text) == len(tampered)
    return f"{header}.{b64url(tampered.encode())}.{signature}"


def tampered_base64_character(scene: Scene) -> str:
    header, payload, signature = scene.issue_a().token.split(".")
    i = len(payload) // 2
    flipped = payload[:i] + ("A" if payload[i] != "A" else "B") + payload[i + 1 :]
    return f"{header}.{flipped}.{signature}"


def revoked_then_replayed(scene: Scene) -> str:
    """A's real token, revoked through the API, presented again once the node has the revocation (pushed on commit
    over the node's queue; waited for here, as it is asynchronous)."""
    issued = scene.issue_a()
    assert scene.client_a.revoke_token(scene.cache_a.id, issued.jti) == 1
    assert eventually(lambda: hello_code(scene, issued.token) == ErrorCode.UNAUTHENTICATED)
    return issued.token


def hello_code(scene: Scene, token: str) -> str:
    with RawConnection(scene.endpoint, scene.pki) as conn:
        frame, _ = conn.hello(scene.cache_a.id, token)
        return "ok" if frame.opcode == Opcode.OK else frame.meta["code"]


@dataclass(frozen=True)
class HostileToken:
    name: str
    make: Callable[[Scene], str]
    code: ErrorCode


HOSTILE_TOKENS = [
    HostileToken("forged by another key", forged_by_another_key, ErrorCode.UNAUTHENTICATED),
    HostileToken("forged, naming the platform's kid", forged_with_the_platform_kid, ErrorCode.UNAUTHENTICATED),
    HostileToken("forged, no kid", forged_without_kid, ErrorCode.UNAUTHENTICATED),
    HostileToken("alg none", alg_none, ErrorCode.UNAUTHENTICATED),
    HostileToken("HS256 keyed with the public key", hs256_keyed_with_the_public_key, ErrorCode.UNAUTHENTICATED),
    HostileToken("expired, platform-signed", expired, ErrorCode.TOKEN_EXPIRED),
    HostileToken("tenant B's real token", tenant_b_token, ErrorCode.NOT_FOUND),
    HostileToken("A's claims for another node", for_another_node, ErrorCode.NOT_FOUND),
    HostileToken("A's claims at an older epoch", for_an_older_epoch, ErrorCode.NOT_FOUND),
    HostileToken("tampered payload character", tampered_payload_character, ErrorCode.UNAUTHENTICATED),
    HostileToken("tampered base64 character", tampered_base64_character, ErrorCode.UNAUTHENTICATED),
    HostileToken("replayed after revocation", revoked_then_replayed, ErrorCode.UNAUTHENTICATED),
]


# ---- the checks ------------------------------------------------------------------------------------------------------


def refused_hello(scene: Scene, pki, cache_id: str, token: str) -> tuple[wire.ErrorReply, bytes]:
    with RawConnection(scene.endpoint, pki) as conn:
        frame, raw = conn.hello(cache_id, token)
        return error_of(frame), raw


def no_data_after_refusal(scene: Scene, pki, token: str, prompt: torch.Tensor) -> list[str]:
    """On a connection whose HELLO for A's cache was refused: LOOKUP, GET and a PUT extending A's prompt, all naming
    A's cache. Returns the problems found (empty when every one was refused without data)."""
    extended = torch.cat([prompt, random_tokens(16, seed=99)[0]])
    requests = {
        "lookup": wire.encode_request(
            Opcode.LOOKUP, 2, cache_id=scene.cache_a.id, identity=scene.spec, token_ids=[ids(prompt)]
        ),
        "get": wire.encode_request(
            Opcode.GET, 3, cache_id=scene.cache_a.id, identity=scene.spec, token_ids=[ids(prompt)]
        ),
        "put": wire.encode_request(
            Opcode.PUT,
            4,
            cache_id=scene.cache_a.id,
            identity=scene.spec,
            token_ids=[ids(extended)],
            kv=[random_kv(scene.spec, len(extended), seed=7).numpy()],
        ),
    }
    problems = []
    with RawConnection(scene.endpoint, pki) as conn:
        error_of(conn.hello(scene.cache_a.id, token)[0])
        for op, request in requests.items():
            frame, raw = conn.exchange(request)
            if frame.opcode != Opcode.ERROR or frame.payload_len or scene.cache_a.id.encode() in raw:
                problems.append(f"{op} answered {frame.opcode.name} {frame.meta} with {frame.payload_len} bytes")
            elif frame.meta["code"] != ErrorCode.UNAUTHENTICATED:
                problems.append(f"{op} refused with {frame.meta['code']}, not unauthenticated")
    return problems


def test_hostile_tokens_are_refused_alike_and_leave_a_intact(live_server, agent, pki, model):
    spec = spec_for(model)
    capacity = {"device": 64 * spec.block_bytes}
    client_a, client_b = kcaas.Client(live_server.url, tenant_key()), kcaas.Client(live_server.url, tenant_key())
    dp_a = None
    try:
        cache_a = client_a.attach("a", spec, capacity, timeout=30)
        cache_b = client_b.attach("b", spec, capacity, timeout=30)
        assert cache_a.endpoint == cache_b.endpoint == agent.endpoint
        scene = Scene(spec, agent.endpoint, client_a, client_b, cache_a, cache_b, pki)

        prompt = random_tokens(PROMPT_TOKENS, seed=5)[0]
        kv = random_kv(spec, PROMPT_TOKENS, seed=6)
        dp_a = DataPlaneClient(
            agent.endpoint,
            TokenSource(client_a, cache_a.id, access="readwrite"),
            cache_a.id,
            spec,
            ssl_context=client_tls(pki),
            timeout=10.0,
        )
        assert dp_a.put(prompt, kv)["num_cached"] == PROMPT_TOKENS

        # the control: A's own real token opens A's cache over the same hand-made client
        with RawConnection(agent.endpoint, pki) as conn:
            ok, _ = conn.hello(cache_a.id, scene.issue_a().token)
            assert ok.opcode == Opcode.OK and ok.meta["cache_id"] == cache_a.id

        problems: dict[str, list[str]] = {}
        for case in HOSTILE_TOKENS:
            token = case.make(scene)
            found = []
            against_a, raw_a = refused_hello(scene, pki, cache_a.id, token)
            against_nothing, raw_nothing = refused_hello(scene, pki, str(uuid.uuid4()), token)
            if against_a.code != case.code:
                found.append(f"refused with {against_a.code} ({against_a.message!r}), documented: {case.code}")
            if raw_a != raw_nothing:
                found.append(f"A's cache answers {raw_a!r}, a cache that does not exist {raw_nothing!r}")
            if cache_a.id in against_a.message + json.dumps(against_a.details):
                found.append("the refusal names A's cache")
            found += no_data_after_refusal(scene, pki, token, prompt)
            if found:
                problems[case.name] = found
        assert not problems, json.dumps(problems, indent=2)

        # B's real token presented for A's cache: code and message byte for byte those of a nonexistent cache
        token_b = tenant_b_token(scene)
        (a_reply, a_raw), (none_reply, none_raw) = (
            refused_hello(scene, pki, cache_a.id, token_b),
            refused_hello(scene, pki, str(uuid.uuid4()), token_b),
        )
        assert a_reply.code == none_reply.code == ErrorCode.NOT_FOUND
        assert a_reply.message.encode() == none_reply.message.encode() and a_raw == none_raw

        # B authenticated on its own cache, naming A's cache in data requests on that connection: no session
        with RawConnection(agent.endpoint, pki) as conn:
            assert conn.hello(cache_b.id, token_b)[0].opcode == Opcode.OK
            for op in (Opcode.LOOKUP, Opcode.GET):
                frame, raw = conn.exchange(
                    wire.encode_request(
                        op, conn.new_id() + 10, cache_id=cache_a.id, identity=spec, token_ids=[ids(prompt)]
                    )
                )
                assert error_of(frame).code == ErrorCode.UNAUTHENTICATED and not frame.payload_len
            put = wire.encode_request(
                Opcode.PUT,
                20,
                cache_id=cache_a.id,
                identity=spec,
                token_ids=[ids(torch.cat([prompt, prompt[:16]]))],
                kv=[random_kv(spec, PROMPT_TOKENS + 16, seed=8).numpy()],
            )
            assert error_of(conn.exchange(put)[0]).code == ErrorCode.UNAUTHENTICATED
            # the stream stayed in sync past the discarded payload: B's own cache still answers on it
            frame, _ = conn.exchange(
                wire.encode_request(Opcode.LOOKUP, 21, cache_id=cache_b.id, identity=spec, token_ids=[ids(prompt)])
            )
            assert frame.opcode == Opcode.OK and frame.meta["num_cached"] == [0]

        # A is intact: no refused PUT changed it, and its own client reads back exactly the bytes it put
        assert dp_a.lookup(torch.cat([prompt, random_tokens(16, seed=99)[0]])) == PROMPT_TOKENS
        assert dp_a.lookup(torch.cat([prompt, prompt[:16]])) == PROMPT_TOKENS
        n, got = dp_a.get(prompt)
        assert n == PROMPT_TOKENS and torch.equal(got, kv)
    finally:
        if dp_a is not None:
            dp_a.close()
        client_a.close()
        client_b.close()


def test_a_revoked_token_is_cut_off_on_its_open_connection(live_server, agent, pki, model):
    """Revocation through the REST API reaches the agent process over its Celery queue and refuses the token on a
    connection it had already opened; a fresh token (what the SDK's TokenSource fetches) works again."""
    spec = spec_for(model)
    client = kcaas.Client(live_server.url, tenant_key())
    try:
        cache = client.attach("revoked", spec, {"device": 16 * spec.block_bytes}, timeout=30)
        issued = client.issue_token(cache.id, access="readwrite")
        prompt = random_tokens(16, seed=11)[0]
        with DataPlaneClient(
            agent.endpoint, issued.token, cache.id, spec, ssl_context=client_tls(pki), timeout=10.0
        ) as dp:
            assert dp.lookup(prompt) == 0  # authenticated with the plain token string (no refresh)
            assert client.revoke_token(cache.id) == 1  # every outstanding token of the cache

            def refused() -> bool:
                try:
                    dp.lookup(prompt)
                except kcaas.dataplane.DataPlaneError as exc:
                    return exc.code == ErrorCode.UNAUTHENTICATED
                return False

            assert eventually(refused)
        with DataPlaneClient(
            agent.endpoint,
            TokenSource(client, cache.id, access="readwrite"),
            cache.id,
            spec,
            ssl_context=client_tls(pki),
            timeout=10.0,
        ) as dp:
            assert dp.lookup(prompt) == 0
    finally:
        client.close()


def test_suspending_the_tenant_or_revoking_the_key_cuts_the_data_plane(live_server, agent, pki, model):
    """What a key or a tenant mints dies with it, on the node: the tenant's suspension (or the minting key's
    revocation) through the tenants room alone, then the cascade beat runs, pushes the tokens to the agent process,
    which cuts the live connection; the tokens are refused on a new one too."""
    from caches.token_cascade import data_tokens_revoke_cascade
    from tenants import services as tenant_services
    from tenants.models import ApiKey, Tenant

    spec = spec_for(model)
    raw_key = tenant_key()
    client = kcaas.Client(live_server.url, raw_key)
    try:
        cache = client.attach("cut", spec, {"device": 16 * spec.block_bytes}, timeout=30)
        prompt = random_tokens(16, seed=12)[0]
        issued = client.issue_token(cache.id, access="readwrite")
        conn = RawConnection(agent.endpoint, pki)
        frame, _ = conn.exchange(wire.encode_hello(conn.new_id(), cache_id=cache.id, token=issued.token))
        assert frame.opcode == Opcode.OK
        key = ApiKey.objects.get(public_id=raw_key.split("_")[2])
        tenant_services.api_key_revoke(api_key=key)
        assert data_tokens_revoke_cascade() == 1  # what beat does within KCAAS_TOKEN_CASCADE_SECONDS
        assert eventually(conn.closed, timeout=20)  # pushed to the agent: its session is cut, not merely refused
        with DataPlaneClient(
            agent.endpoint, issued.token, cache.id, spec, ssl_context=client_tls(pki), timeout=10.0
        ) as dp:
            with pytest.raises(kcaas.dataplane.DataPlaneError) as refused:
                dp.lookup(prompt)
        assert refused.value.code == ErrorCode.UNAUTHENTICATED

        tenant = key.tenant
        second = tenant_services.api_key_issue(tenant=tenant, scopes=["caches:read", "caches:write"]).raw_key
        client2 = kcaas.Client(live_server.url, second)
        token = client2.issue_token(cache.id, access="readwrite").token
        with DataPlaneClient(agent.endpoint, token, cache.id, spec, ssl_context=client_tls(pki), timeout=10.0) as dp:
            assert dp.lookup(prompt) == 0
            tenant_services.tenant_set_status(tenant=Tenant.objects.get(pk=tenant.pk), status=Tenant.Status.SUSPENDED)
            assert data_tokens_revoke_cascade(tenant_id=tenant.pk) == 1

            def refused_now() -> bool:
                try:
                    dp.lookup(prompt)
                except kcaas.dataplane.DataPlaneError as exc:
                    return exc.code == ErrorCode.UNAUTHENTICATED
                return False

            assert eventually(refused_now, timeout=20)
        client2.close()
    finally:
        client.close()
