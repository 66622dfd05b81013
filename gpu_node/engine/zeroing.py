"""The node's one way to let go of a buffer that held a tenant's bytes: overwrite it with zeros first, so no KV or
token ids are left in freed heap memory (after an erasure nothing of the tenant may remain in the process)."""

from __future__ import annotations

import numpy as np


def zero(buf) -> None:
    """Overwrite a buffer with zeros in place: a tensor (any device: its own zero_), or a writable bytes-like object
    (bytearray, memoryview, numpy array: one memset)."""
    if hasattr(buf, "zero_"):
        buf.zero_()
        return
    view = memoryview(buf)
    if view.nbytes:
        np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8).fill(0)
