"""Opens the audit request scope (audit/context.py) around every request: request id, source IP, actor resolver."""

from __future__ import annotations

import ipaddress

from django.conf import settings

from audit.context import REQUEST_ID_RE, RequestInfo, actor_of, new_request_id, request_scope

REQUEST_ID_HEADER = "X-Request-ID"


def source_ip(request) -> str | None:
    """REMOTE_ADDR, or the client named by X-Forwarded-For when the direct peer is a trusted proxy
    (settings.KCAAS_TRUSTED_PROXIES, a list of addresses/networks; empty: trust none)."""
    remote = request.META.get("REMOTE_ADDR") or None
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    trusted = getattr(settings, "KCAAS_TRUSTED_PROXIES", [])
    if remote and forwarded and trusted and _in_networks(remote, trusted):
        candidate = forwarded.split(",")[-1].strip()
        if _valid_ip(candidate):
            return candidate
    return remote if remote and _valid_ip(remote) else None


def _valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _in_networks(address: str, networks) -> bool:
    try:
        ip = ipaddress.ip_address(address)
        return any(ip in ipaddress.ip_network(net, strict=False) for net in networks)
    except ValueError:
        return False


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        given = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = given if REQUEST_ID_RE.match(given) else new_request_id()
        request.request_id = request_id
        info = RequestInfo(request_id, source_ip(request), lambda: actor_of(getattr(request, "user", None)))
        with request_scope(info):
            response = self.get_response(request)
        response[REQUEST_ID_HEADER] = request_id
        return response
