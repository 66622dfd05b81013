"""API key format, generation and hashing. No Django models here: fleet reuses it for node credentials.

Format: ``<prefix>_<public_id>_<secret><crc>``, for instance ``kc_live_3hT0...`` for tenant keys and ``kc_node_...`` for
node credentials.

- ``prefix``: ``kc_`` + lowercase letters. Typed so secret scanners (GitHub push protection and the like) know what
  they found.
- ``public_id``: 16 base62 characters (~95 bits), the lookup handle stored in clear.
- ``secret``: 43 base62 characters (256 bits) from ``secrets``; never stored, only its HMAC-SHA256.
- ``crc``: 6 base62 characters of CRC32 over everything before it, so a scanner (or this module) can tell a real key
  from a typo or a random string offline, without a database round trip.

Invariants:
- ``parse_key(generate_key(p)[0])`` returns ``(p, public_id, secret)``; any single changed character is caught by the
  CRC (CRC32 detects every single-symbol error) or by the shape check.
- Hashes are keyed with ``settings.KCAAS_KEY_PEPPER`` (read on each call), so a leaked table cannot be checked offline.
  The secret has 256 bits of entropy, so a fast hash is right; a password hasher would only cost latency.
- Comparison is ``hmac.compare_digest``; callers that find no stored hash compare against ``DUMMY_HASH`` so the
  "unknown id" path does the same work as the "wrong secret" path.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
import zlib

from django.conf import settings

BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
PUBLIC_ID_LENGTH = 16
SECRET_LENGTH = 43  # 43 * log2(62) = 256.03 bits
CRC_LENGTH = 6  # 62**6 > 2**32
TENANT_KEY_PREFIX = "kc_live"
NODE_KEY_PREFIX = "kc_node"
MAX_KEY_LENGTH = 100  # longer input is refused before the regex runs

_PREFIX_RE = re.compile(r"kc_[a-z]{1,16}")
_KEY_RE = re.compile(
    rf"(?P<prefix>kc_[a-z]{{1,16}})_(?P<public_id>[0-9A-Za-z]{{{PUBLIC_ID_LENGTH}}})_"
    rf"(?P<secret>[0-9A-Za-z]{{{SECRET_LENGTH}}})(?P<crc>[0-9A-Za-z]{{{CRC_LENGTH}}})"
)


class InvalidKeyFormat(ValueError):
    """The string is not a well-formed key (shape or checksum); nothing was looked up."""


def _random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(length))


def _base62_fixed(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        value, digit = divmod(value, 62)
        chars.append(BASE62[digit])
    return "".join(reversed(chars))


def checksum(body: str) -> str:
    """The 6-character base62 CRC32 of ``body`` (everything in a key before the checksum)."""
    return _base62_fixed(zlib.crc32(body.encode("ascii")), CRC_LENGTH)


def generate_key(prefix: str = TENANT_KEY_PREFIX) -> tuple[str, str, str]:
    """A fresh key: ``(raw, public_id, secret)``. The raw key is shown once; store only ``key_hash(secret)``."""
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"bad key prefix {prefix!r}: expected kc_ followed by lowercase letters")
    public_id = _random_base62(PUBLIC_ID_LENGTH)
    secret = _random_base62(SECRET_LENGTH)
    body = f"{prefix}_{public_id}_{secret}"
    return body + checksum(body), public_id, secret


def parse_key(raw: str) -> tuple[str, str, str]:
    """Split a raw key into ``(prefix, public_id, secret)``; raise InvalidKeyFormat on a bad shape or checksum."""
    if not isinstance(raw, str) or len(raw) > MAX_KEY_LENGTH:
        raise InvalidKeyFormat("not a KCaaS key")
    match = _KEY_RE.fullmatch(raw)
    if match is None:
        raise InvalidKeyFormat("not a KCaaS key")
    body = raw[:-CRC_LENGTH]
    if not hmac.compare_digest(checksum(body), match["crc"]):
        raise InvalidKeyFormat("key checksum mismatch")
    return match["prefix"], match["public_id"], match["secret"]


def is_well_formed(raw: str) -> bool:
    """Offline check a secret scanner can run: shape and CRC only."""
    try:
        parse_key(raw)
    except InvalidKeyFormat:
        return False
    return True


def key_hash(secret: str) -> str:
    """Hex HMAC-SHA256 of the secret under the server pepper."""
    pepper = settings.KCAAS_KEY_PEPPER
    if not pepper:
        raise RuntimeError("settings.KCAAS_KEY_PEPPER is empty")
    return hmac.new(pepper.encode(), secret.encode("ascii"), hashlib.sha256).hexdigest()


# Compared against when no key has the presented public id: same length as a real hash, matches no secret.
DUMMY_HASH = "0" * 64


def verify_secret(secret: str, stored_hash: str | None) -> bool:
    """Constant-time check of ``secret`` against a stored hash; ``None`` (unknown id) costs the same and fails."""
    presented = key_hash(secret)
    matches = hmac.compare_digest(presented, stored_hash if stored_hash is not None else DUMMY_HASH)
    return matches and stored_hash is not None
