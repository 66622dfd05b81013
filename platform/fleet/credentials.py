"""Node credentials: `kc_node_<public_id>_<secret><crc>`, the tenants' key format (core.keys) with its own prefix.

A credential is shown once, when staff create the node; the database keeps its public id (the lookup key) and the
peppered HMAC-SHA256 of its secret (core.keys.key_hash). Verification compares hashes in constant time and does
the same work when the public id is unknown (core.keys.verify_secret), so timing does not tell which nodes exist.
"""

from dataclasses import dataclass

from core.keys import NODE_KEY_PREFIX, InvalidKeyFormat, generate_key, key_hash, parse_key, verify_secret


@dataclass(frozen=True, slots=True)
class NewCredential:
    raw: str  # the full credential, returned to staff once and never stored
    public_id: str
    secret_hash: str


def credential_new() -> NewCredential:
    raw, public_id, secret = generate_key(prefix=NODE_KEY_PREFIX)
    return NewCredential(raw=raw, public_id=public_id, secret_hash=key_hash(secret))


def is_node_credential(token: str) -> bool:
    """Whether a bearer token claims to be a node credential (other authenticators handle everything else)."""
    return token.startswith(NODE_KEY_PREFIX + "_")


def credential_parse(raw: str) -> tuple[str, str] | None:
    """(public_id, secret) of a well-formed node credential, or None (bad shape, checksum or prefix)."""
    try:
        prefix, public_id, secret = parse_key(raw)
    except InvalidKeyFormat:
        return None
    if prefix != NODE_KEY_PREFIX:
        return None
    return public_id, secret


def credential_matches(*, secret: str, stored_hash: str | None) -> bool:
    """Constant-time check of a secret against a node's stored hash; None (no such node) costs the same, fails."""
    return verify_secret(secret, stored_hash)
