"""Fleet's refusals: each an ApplicationError with a stable code, rendered in the one error shape."""

from rest_framework import status

from core.errors import ApplicationError, ConflictError


class NoCapacity(ApplicationError):
    """No ready node with a live lease has the requested bytes free on every requested tier."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    code = "no_capacity"


class InvalidCapacity(ApplicationError):
    """A capacity mapping names an unknown tier, or holds a negative, non-integer or out-of-bounds value."""

    code = "invalid_capacity"


class InvalidEndpoint(ApplicationError):
    """Not a connectable host:port."""

    code = "invalid_endpoint"


class InvalidNodeName(ApplicationError):
    code = "invalid_node_name"


class EndpointInUse(ConflictError):
    """Another live node already answers on this endpoint."""

    code = "endpoint_in_use"


class NodeNameTaken(ConflictError):
    code = "node_name_taken"


class InvalidNodeState(ConflictError):
    """The node's state does not allow the requested transition (e.g. cordoning a lost node)."""

    code = "invalid_node_state"


class ReregisterRequired(ConflictError):
    """A heartbeat from a node that is lost (or never registered): the agent must call register again."""

    code = "reregister_required"


class InvalidCsr(ApplicationError):
    """A certificate signing request the platform CA refuses; `code` says why: csr_malformed (not one PEM CSR),
    csr_signature_invalid (its self-signature does not verify: the sender does not hold the key), or
    csr_key_unsupported (not an ECDSA P-256 public key)."""

    code = "csr_malformed"


class InvalidSealingKey(ApplicationError):
    """A registration's `sealing_public_key` that no key can be sealed to: not base64 of 32 bytes, or a low-order
    X25519 point."""

    code = "invalid_sealing_key"


class NodeSealingKeyMissing(Exception):
    """An order that carries keys for a node with no sealing key on record (its agent registered without one: older
    than key sealing). Nothing is sent: no key travels in clear; the order is tried again after a backoff and goes
    once the node registers a key."""
