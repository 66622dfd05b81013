"""Key material sealed to one node: the boxes control -> node messages carry instead of keys in clear.

Both sides import this module (stdlib + cryptography: no Django, no torch). A node agent holds an X25519 key pair
(`NodeSealingKey`, kept with its identity, gpu_node/agent/identity.py); its public half goes to the control plane in the
node's authenticated registration and is stored on the Node row. The control plane seals each secret of a message
(a cache's block-hash key, its SSD data key) to that public key at send time:

    box = "kcs1." base64url( kid (8) || ephemeral X25519 public key (32) || nonce (12) || AES-256-GCM ciphertext+tag )

    shared = X25519(ephemeral private, node public)
    key    = HKDF-SHA256(shared, salt = ephemeral public || node public, info = "kcaas/node-sealed-key/v1")
    aad    = "kcaas-sealed/v1" 0 task 0 node id 0 cache id 0 field 0 kid

`kid` names the node key a box was sealed to (the first 8 bytes of SHA-256 of its public half), so a node tells a
box for a key it no longer holds (an agent that restarted without a persisted key: the control plane sends it
again under the key it registered next) from a forged or altered one. The associated data binds a box to one
message: the task name, the receiving node, the cache and the field ("hash_key", "ssd_key"): a box copied into
another task, onto another node's queue, into another cache's message or swapped between the two fields does not
open (AES-GCM refuses it before any byte is released).

Invariants: only the holder of the node's private key can open a box (one fresh ephemeral key per box, so no two
boxes share an AES key and the nonce can never repeat under one key); `open` returns the plaintext or raises
`SealedKeyError`, never a wrong key; nothing here logs or keeps a plaintext.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import uuid

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

BOX_PREFIX = "kcs1."
PUBLIC_KEY_BYTES = 32
KID_BYTES = 8
NONCE_BYTES = 12
_TAG_BYTES = 16
_HKDF_INFO = b"kcaas/node-sealed-key/v1"
_AAD_LABEL = b"kcaas-sealed/v1"
_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)

# Why a box was refused (the node's provisioning answer names it).
KEY_NOT_SEALED = "key_not_sealed"  # a key in clear, or no box at all where one is required
SEALED_KEY_INVALID = "sealed_key_invalid"  # malformed, altered, or sealed for another message/node
SEALED_FOR_OTHER_KEY = "sealed_for_other_key"  # sealed to a node key this node does not hold (now)
NO_SEALING_KEY = "no_sealing_key"  # this node has no sealing key at all


class SealedKeyError(ValueError):
    """A box that does not open here; `reason` is one of the constants above."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def key_id(public_key: bytes) -> str:
    """The hex id of a node's public sealing key (what boxes name their recipient by)."""
    return hashlib.sha256(public_key).digest()[:KID_BYTES].hex()


def public_key_bytes(public_key_b64: str) -> bytes:
    """The 32 raw bytes of a base64 X25519 public key; ValueError when it is not one a box can be sealed to (wrong
    length, or a low-order point whose shared secret would be all zeros)."""
    try:
        raw = base64.b64decode(public_key_b64, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError("not base64") from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an X25519 public key is {PUBLIC_KEY_BYTES} bytes, not {len(raw)}")
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        raise ValueError("a low-order X25519 point") from None
    return raw


def _canonical_id(value) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        return str(value)


def _aad(*, task: str, node_id, cache_id, field: str, kid: bytes) -> bytes:
    parts = (
        _AAD_LABEL,
        task.encode(),
        _canonical_id(node_id).encode(),
        _canonical_id(cache_id).encode(),
        field.encode(),
        kid.hex().encode(),
    )
    return b"\x00".join(parts)


def _aes_key(shared: bytes, ephemeral_public: bytes, node_public: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral_public + node_public, info=_HKDF_INFO).derive(
        shared
    )


def seal(plaintext: bytes, *, public_key_b64: str, task: str, node_id, cache_id, field: str) -> str:
    """A box of `plaintext` that only the holder of `public_key_b64`'s private half opens, and only for this task,
    node, cache and field."""
    node_public = public_key_bytes(public_key_b64)
    kid = bytes.fromhex(key_id(node_public))
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = ephemeral.public_key().public_bytes(*_RAW)
    key = _aes_key(ephemeral.exchange(X25519PublicKey.from_public_bytes(node_public)), ephemeral_public, node_public)
    nonce = os.urandom(NONCE_BYTES)
    body = AESGCM(key).encrypt(
        nonce, plaintext, _aad(task=task, node_id=node_id, cache_id=cache_id, field=field, kid=kid)
    )
    return BOX_PREFIX + base64.urlsafe_b64encode(kid + ephemeral_public + nonce + body).decode().rstrip("=")


def is_box(value) -> bool:
    return isinstance(value, str) and value.startswith(BOX_PREFIX)


class NodeSealingKey:
    """A node's X25519 private key: what opens the boxes sealed to it. Thread-safe (immutable)."""

    def __init__(self, private_key: X25519PrivateKey | None = None):
        self._private = private_key or X25519PrivateKey.generate()
        self._public = self._private.public_key().public_bytes(*_RAW)
        self._kid = bytes.fromhex(key_id(self._public))

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> NodeSealingKey:
        return cls(X25519PrivateKey.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        """The 32 raw private bytes, for the node's own 0600 key file only."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_key_b64(self) -> str:
        """What the node registers: base64 of the 32-byte public key."""
        return base64.b64encode(self._public).decode()

    @property
    def key_id(self) -> str:
        return self._kid.hex()

    def open(self, box: str, *, task: str, node_id, cache_id, field: str) -> bytes:
        """The plaintext of a box sealed to this key for exactly this task, node, cache and field; SealedKeyError
        otherwise (KEY_NOT_SEALED, SEALED_FOR_OTHER_KEY or SEALED_KEY_INVALID)."""
        if not is_box(box):
            raise SealedKeyError(KEY_NOT_SEALED, f"{field}: not a sealed box")
        text = box[len(BOX_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise SealedKeyError(SEALED_KEY_INVALID, f"{field}: a malformed box") from None
        if len(raw) < KID_BYTES + PUBLIC_KEY_BYTES + NONCE_BYTES + _TAG_BYTES:
            raise SealedKeyError(SEALED_KEY_INVALID, f"{field}: a truncated box")
        kid, raw = raw[:KID_BYTES], raw[KID_BYTES:]
        if kid != self._kid:
            raise SealedKeyError(
                SEALED_FOR_OTHER_KEY, f"{field}: sealed to node key {kid.hex()}, this node holds {self._kid.hex()}"
            )
        ephemeral_public, nonce, body = (
            raw[:PUBLIC_KEY_BYTES],
            raw[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + NONCE_BYTES],
            raw[PUBLIC_KEY_BYTES + NONCE_BYTES :],
        )
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(ephemeral_public))
            key = _aes_key(shared, ephemeral_public, self._public)
            return AESGCM(key).decrypt(
                nonce, body, _aad(task=task, node_id=node_id, cache_id=cache_id, field=field, kid=kid)
            )
        except (InvalidTag, ValueError):
            raise SealedKeyError(SEALED_KEY_INVALID, f"{field}: the box does not open for this message") from None
