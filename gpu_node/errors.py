"""The node's errors: one base class, NodeError, for every error the node raises on purpose.

Each subclass carries, as the class attribute `code`, the data-plane wire ErrorCode a request that meets it is
answered with (kcaas/wire/frames.py: `internal` for failures that are the node's own, which never carry their text),
and `details()`, the answer's machine-readable details. The data plane maps an error to its answer with
`isinstance(exc, NodeError)` and `exc.code` (`answer_error`), never by probing attributes.

The caller's duty: code that can degrade — treat a failed tier read as a miss, a failed transfer as a resend, a
refused provisioning as a failure report — catches NodeError (or the subclass it expects), never a bare Exception.
Each subclass also keeps the built-in base its callers have always caught (a purged cache is a RuntimeError, KV that
cannot be stored a ValueError), so the hierarchy changes no caller.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kcaas.wire import ErrorCode, ProtocolError

# The one answer for a cache this node does not serve to this token (absent, another tenant's, purged): the same text
# whatever the reason, so an answer tells nothing of other tenants' caches.
NOT_FOUND_MESSAGE = "no such cache on this node, or the token does not grant it"


class NodeError(Exception):
    """Base of the node's errors (module docstring). `code`: the wire ErrorCode a data-plane answer carries."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def details(self) -> dict[str, Any]:
        """Machine-readable details of the answer (none unless a subclass says)."""
        return {}

    def public_message(self) -> str:
        """What an answer may say: the message for client errors; nothing of the node's own failures."""
        return "internal error" if self.code == ErrorCode.INTERNAL else str(self)


def answer_error(exc: NodeError, **extra_details: Any) -> ProtocolError:
    """The wire error a data-plane request that met `exc` is answered with (`extra_details` added, e.g. the index of
    the sequence in a batch)."""
    return ProtocolError(exc.code, exc.public_message(), details={**exc.details(), **extra_details})
