"""Console session expiry and response headers.

A console session ends after `KCAAS_CONSOLE_IDLE_SECONDS` without a request the user made (htmx polling, marked by
the `X-Console-Poll` header, does not count: an open tab does not keep a session alive) or
`KCAAS_CONSOLE_MAX_SESSION_SECONDS` after sign-in, whichever comes first. Ending it records console.logout with the
reason `expired` and sends the user to the sign-in page. Console answers carry a strict Content-Security-Policy
(no inline script or style: htmx is a static file, bars are <meter>, charts are SVG attributes).
"""

from __future__ import annotations

import time

from django.conf import settings

from console import access, sessions

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
POLL_HEADER = "X-Console-Poll"


class ConsoleSessionMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.path.startswith("/console/"):
            return self.get_response(request)
        if request.session.get(access.SESSION_FLAG) and request.user.is_authenticated:
            now = time.time()
            if _expired(request.session, now):
                sessions.end_session(request, reason="expired")
                return _headers(access.login_redirect(request, reason="expired"))
            if not request.headers.get(POLL_HEADER):
                request.session[sessions.LAST_SEEN] = now
        return _headers(self.get_response(request))


def _expired(session, now: float) -> bool:
    started = session.get(sessions.STARTED, 0)
    last_seen = session.get(sessions.LAST_SEEN, started)
    return (
        now - last_seen > settings.KCAAS_CONSOLE_IDLE_SECONDS
        or now - started > settings.KCAAS_CONSOLE_MAX_SESSION_SECONDS
    )


def _headers(response):
    response.setdefault("Content-Security-Policy", CSP)
    response.setdefault("Referrer-Policy", "same-origin")
    response.setdefault("X-Content-Type-Options", "nosniff")
    return response
