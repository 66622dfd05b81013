"""Input rules shared by fleet's services and serializers: endpoints, node names, capacities per tier.

Services validate again what serializers validated, so a caller from another room (or a Celery task) cannot slip a
bad value past the REST layer.
"""

import ipaddress
import re

from fleet.models import TIERS

MAX_TIER_BYTES = 2**50  # 1 PiB per tier per node: far above any real node, far below BigIntegerField's limit
MAX_ENDPOINT_LENGTH = 262  # a 253-character host name, ":" and a 5-digit port, or a bracketed IPv6 address
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_PORT_RE = re.compile(r"^[0-9]{1,5}$")


def endpoint_error(value: object) -> str | None:
    """Why `value` is not a connectable "host:port" (host name, IPv4, or [IPv6]), or None when it is one.

    Unspecified addresses (0.0.0.0, ::) are refused: clients must be able to dial the endpoint.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_ENDPOINT_LENGTH:
        return f"must be a host:port string of at most {MAX_ENDPOINT_LENGTH} characters"
    host, sep, port = value.rpartition(":")
    if not sep or not _PORT_RE.match(port) or not 1 <= int(port) <= 65535:
        return "must end with :port, a port between 1 and 65535"
    if host.startswith("[") and host.endswith("]"):
        if "%" in host:
            return "an IPv6 zone id (%...) only means something on one host"
        return _ip_error(host[1:-1], version=6)
    if ":" in host:
        return "an IPv6 address must be written in brackets, e.g. [::1]:7000"
    if re.fullmatch(r"[0-9.]+", host):
        return _ip_error(host, version=4)
    if not host or len(host) > 253 or not all(_HOST_LABEL_RE.match(label) for label in host.split(".")):
        return "host must be a DNS name, an IPv4 address or a bracketed IPv6 address"
    return None


def _ip_error(text: str, *, version: int) -> str | None:
    try:
        address = ipaddress.IPv4Address(text) if version == 4 else ipaddress.IPv6Address(text)
    except ValueError:
        return f"host is not a valid IPv{version} address"
    if address.is_unspecified or address.is_multicast:
        return "host must be a unicast address a client can connect to"
    return None


def endpoint_normalize(value: str) -> str:
    """The canonical spelling of a valid endpoint: host names lower-cased, IPv6 compressed."""
    host, _, port = value.rpartition(":")
    if host.startswith("["):
        host = f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
    return f"{host.lower()}:{int(port)}"


def capacity_errors(capacity: object, *, require_all: bool) -> dict[str, str]:
    """Per-tier complaints about a {tier: bytes} mapping ({} when it is valid).

    Tiers are "device", "dram", "ssd"; each value an int (not a bool) in [0, MAX_TIER_BYTES]. With `require_all`
    every tier must be present (a node reports its whole capacity); otherwise missing tiers mean 0.
    """
    if not isinstance(capacity, dict):
        return {"capacity": "must be an object mapping tier names to byte counts"}
    errors = {str(tier): f"unknown tier; expected one of {', '.join(TIERS)}" for tier in capacity if tier not in TIERS}
    for tier in TIERS:
        if tier not in capacity:
            if require_all:
                errors[tier] = "this tier is required"
            continue
        value = capacity[tier]
        if isinstance(value, bool) or not isinstance(value, int):
            errors[tier] = "must be an integer number of bytes"
        elif not 0 <= value <= MAX_TIER_BYTES:
            errors[tier] = f"must be between 0 and {MAX_TIER_BYTES}"
    return errors
