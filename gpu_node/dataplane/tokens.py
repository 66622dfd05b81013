"""Data-token checks on the node: `TokenVerifier` (offline EdDSA verification against the control plane's JWKS) and
`RevocationList` (the jtis the control plane revoked, each kept until its token would have expired anyway).

Revocations reach a node two ways, both idempotent: pushed at once on its Celery queue (`revoke_tokens`, sent when
the control plane commits a revocation), and as the full list of unexpired revoked tokens of the caches it hosts in
every register and heartbeat answer (`revoked_tokens`), which covers a lost message and an agent restart: a
restarted agent refuses a revoked token from its first HELLO, because it registers before it serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import jwt

from kcaas.wire import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

DEFAULT_ISSUER = "kcaas-control-plane"
REQUIRED_CLAIMS = ["exp", "iat", "nbf", "aud", "iss", "sub", "jti"]


class RevocationList:
    """jti -> the token's exp (unix seconds). A jti is refused while listed; an entry leaves once its token has
    expired (plus the verifier's leeway), when nothing could present it successfully any more.

    Invariant: every listed jti maps to a finite exp; `prune(now)` never drops an entry with exp + leeway > now.
    """

    def __init__(self, *, leeway: float = 5.0, clock=time.time):
        self.leeway = leeway
        self._clock = clock
        self._lock = threading.Lock()
        self._exp_by_jti: dict[str, float] = {}
        self._next_prune = 0.0
        self._listeners: list = []  # called with the set of newly listed jtis (the data plane cuts their sessions)

    def add_listener(self, listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def add(self, jti: Any, exp: Any = None) -> None:
        """List `jti` until `exp` (unknown exp: kept for a day, longer than any data token lives)."""
        self._add_many([(jti, exp)])

    def update(self, entries: Iterable[Any] | None) -> int:
        """Add [{"jti", "exp"}] (register/heartbeat answers, the revoke_tokens task); malformed entries are skipped.
        Returns how many were well-formed."""
        pairs = [(e["jti"], e.get("exp")) for e in entries or () if isinstance(e, dict) and e.get("jti")]
        self._add_many(pairs)
        return len(pairs)

    def _add_many(self, pairs: list) -> None:
        added = set()
        with self._lock:
            for jti, exp in pairs:
                try:
                    until = float(exp) if exp is not None else self._clock() + 86_400.0
                except (TypeError, ValueError):
                    until = self._clock() + 86_400.0
                key = str(jti)
                if key not in self._exp_by_jti:
                    added.add(key)
                self._exp_by_jti[key] = max(until, self._exp_by_jti.get(key, until))
            listeners = list(self._listeners)
        if added:
            for listener in listeners:
                try:
                    listener(added)
                except Exception:
                    log.exception("a revocation listener failed")

    def __contains__(self, jti: Any) -> bool:
        now = self._clock()
        with self._lock:
            if now >= self._next_prune:
                self._prune_locked(now)
            return str(jti) in self._exp_by_jti

    def __len__(self) -> int:
        with self._lock:
            return len(self._exp_by_jti)

    def _prune_locked(self, now: float) -> None:
        """Drop entries whose token has expired (at most once a minute). The list's size is bounded by the control
        plane's quota of outstanding tokens per tenant, since only unexpired tokens stay listed."""
        self._next_prune = now + 60.0
        for jti in [jti for jti, exp in self._exp_by_jti.items() if exp + self.leeway <= now]:
            del self._exp_by_jti[jti]


class TokenVerifier:
    """Verifies data tokens offline against the control plane's published Ed25519 keys (a JWKS dict).

    `verify(token)` checks the signature (EdDSA only; the token's own `alg` is never trusted), iss, exp, nbf, the
    required claims and the revocation set, and returns the claims. Whether the token grants a particular cache is
    the server's check (audience, node, epoch), so every "not for this cache" answers alike.
    """

    def __init__(
        self,
        jwks: dict,
        *,
        issuer: str = DEFAULT_ISSUER,
        leeway: float = 5.0,
        fetch_jwks=None,
        refetch_interval: float = 30.0,
        revocations: RevocationList | None = None,
    ):
        """`revocations`: the node's RevocationList (the agent shares one with its Celery tasks); a fresh one if
        None. `fetch_jwks()` (optional) reloads the JWKS when a token names an unknown `kid` (key rotation), at most
        once per `refetch_interval` seconds, so forged kids cannot make the node hammer the control plane."""
        self.issuer = issuer
        self.leeway = leeway
        self._fetch_jwks = fetch_jwks
        self._refetch_interval = refetch_interval
        self._last_fetch = float("-inf")
        self._lock = threading.Lock()
        self._keys: dict[str | None, Any] = {}
        self.revocations = revocations if revocations is not None else RevocationList(leeway=leeway)
        self.update_jwks(jwks)

    def update_jwks(self, jwks: dict) -> None:
        keys: dict[str | None, Any] = {}
        for jwk in jwks.get("keys", []):
            if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
                continue  # only Ed25519 keys verify data tokens
            keys[jwk.get("kid")] = jwt.PyJWK(jwk, algorithm="EdDSA").key
        if not keys:
            raise ValueError("the JWKS holds no Ed25519 key")
        with self._lock:
            self._keys = keys

    def revoke(self, jti: str, exp: Any = None) -> None:
        self.revocations.add(jti, exp)

    def is_revoked(self, jti: Any) -> bool:
        return jti in self.revocations

    def _key_for(self, kid: Any) -> Any:
        with self._lock:
            if kid in self._keys:
                return self._keys[kid]
            if kid is None and len(self._keys) == 1:
                return next(iter(self._keys.values()))
        return None

    def verify(self, token: str) -> dict:
        """The token's verified claims; ProtocolError unauthenticated / token_expired otherwise."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "malformed token") from None
        if header.get("alg") != "EdDSA":
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "the token is not signed with EdDSA")
        key = self._key_for(header.get("kid"))
        refetch_due = time.monotonic() - self._last_fetch >= self._refetch_interval
        if key is None and self._fetch_jwks is not None and refetch_due:
            self._last_fetch = time.monotonic()
            try:
                self.update_jwks(self._fetch_jwks())
            except Exception:
                log.warning("could not refresh the data-token JWKS", exc_info=True)
            key = self._key_for(header.get("kid"))
        if key is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "the token's signing key is unknown")
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=["EdDSA"],
                issuer=self.issuer,
                leeway=self.leeway,
                options={"require": REQUIRED_CLAIMS, "verify_aud": False},  # the server matches aud to the cache
            )
        except jwt.ExpiredSignatureError:
            raise ProtocolError(ErrorCode.TOKEN_EXPIRED, "the data token has expired") from None
        except jwt.InvalidTokenError:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "invalid data token") from None
        if self.is_revoked(claims["jti"]):
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "the data token has been revoked")
        return claims
