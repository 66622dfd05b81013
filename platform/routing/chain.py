"""Content names of token blocks, the same for a block an engine announced and for a prompt a router asks about:
key_i = BLAKE2b-128(key_{i-1} || tokens of block i || extras of block i), key_{-1} empty. No Django, no torch.

The engine's own hashes are opaque (vLLM's sha256 with its seed, or a builtin hash that differs per process), so the
index rehashes the tokens the events carry; `extras` are what else the engine's hash covered (the LoRA name, a
cache salt, multimodal identifiers): a block with extras never matches a prompt without them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

KEY_BYTES = 16


def block_key(parent: bytes, tokens: Sequence[int], extras: Any = None) -> bytes:
    """The key of one block given its parent's key (b"" for the first block)."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kcaas-route")
    digest.update(array("q", tokens).tobytes())  # little-endian on every platform the server runs on
    if extras:
        digest.update(repr(tuple(extras)).encode())
    return digest.digest()


def block_keys(tokens: Sequence[int], block_size: int, *, lora_name: str | None = None) -> list[bytes]:
    """The keys of every whole block of `tokens` (a prompt's blocks as an engine of this block size holds them)."""
    keys, parent = [], b""
    extras = (lora_name,) if lora_name else None  # vLLM's extra keys of a LoRA block without salt or media
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size], extras)
        keys.append(parent)
    return keys
