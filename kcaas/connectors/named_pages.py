"""Named pages: an engine's page kept in a cache under the engine's own key (a hash string or bytes), not its tokens.

The data plane keys KV by token prefix. Engine plug-ins that see only a page's key (SGLang's HiCache storage gets a
page hash string; vLLM's offloading tiers get an OffloadKey of bytes) store each page as its own one-page sequence
whose token ids are derived from the key:

    tokens = page_tokens("sglang", key, num_tokens=64)   # the same key always gives the same ids

The ids are SHAKE-256 of a namespace and the key, cut into 31-bit integers: pages of different engines or namespaces
never share ids, and a real prompt reaches a page's ids only by guessing num_tokens * 31 bits. A named page is the
cache's like any block (quota, tiers, deletion, erasure, the tenant's own data token), but it is reachable only by its
key: the full connectors, which key by tokens, do not see it, and its routing events name ids no prompt has.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["NAMESPACE_VERSION", "page_tokens"]

NAMESPACE_VERSION = b"kcaas-named-page/v1"
_TOKEN_MASK = 0x7FFFFFFF  # non-negative int32 ids


def page_tokens(namespace: str, key: str | bytes, num_tokens: int) -> memoryview:
    """The num_tokens int32 token ids that stand for page `key` in `namespace` (deterministic; an int32 memoryview).

    Raises: ValueError for an empty namespace or key, or num_tokens < 1.
    """
    if not namespace or num_tokens < 1:
        raise ValueError("a named page needs a namespace and at least one token")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError("a named page needs a non-empty key")
    seed = hashlib.shake_256()
    for part in (NAMESPACE_VERSION, namespace.encode(), raw):
        seed.update(len(part).to_bytes(4, "little") + part)  # length-prefixed: no two (namespace, key) pairs alike
    ids = array("i")
    ids.frombytes(seed.digest(4 * num_tokens))
    for i, value in enumerate(ids):
        ids[i] = value & _TOKEN_MASK
    return memoryview(ids)
