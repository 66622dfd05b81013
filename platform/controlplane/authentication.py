"""Staff authentication for the REST API that console users cannot use, and the throttle of its password door.

A console user signs in with a password and a TOTP code and acts within a role (console.roles). Accepting that
user's password alone (HTTP Basic) or the console's session cookie on the REST API, where staff may do everything,
would bypass both; so these refuse them (the request is then unauthenticated: 401/403 as for anyone). Platform
administrators without a console role authenticate as before.

HTTP Basic is a password door, so (docs/console.md, "Getting in"):
- Every refusal looks the same: an unknown user, a wrong password, an inactive user and a console user (right
  password or not) each answer 401 `authentication_failed` "Invalid username/password." after the same work — one
  password hash (Django's ModelBackend hashes a dummy for unknown users; a console user's password is checked, then
  refused). So the API is no password oracle for console users around the console's own throttle.
- Failed tries are limited per account (the username, casefolded; named in Redis only by an HMAC) and per source
  (the client address from audit.middleware.source_ip: X-Forwarded-For only from settings.KCAAS_TRUSTED_PROXIES;
  IPv6 by /64), GCRA in Redis (tenants.ratelimit.take_all). The cells are taken BEFORE the password hash is computed,
  all or none, so a refused try costs no hash: 429 `too_many_attempts` with `details.retry_after_seconds` and
  Retry-After, the same whichever limit refused. A try that succeeds gives its cells back: normal use is never
  counted. Defaults: 10 failures per account and 30 per source per minute (each: that many at once, then one per
  window/count).
- Repeating a credential this process refused in the last KCAAS_PASSWORD_FAILURE_MEMO_SECONDS is refused again
  without a hash and without counting (a script with a stale password does not lock its account out, a flood of one
  wrong credential costs no CPU). The memo is an in-process LRU keyed by an HMAC under a key that never leaves the
  process, over the username, the password and the account's standing (stored hash, active, console role): a password
  change, activation or role change takes effect at once. Right and wrong passwords of a console user are memoised
  alike, so repeating them answers alike too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.hashers import make_password
from django.contrib.auth.models import Group
from django.db.models import Exists, OuterRef
from drf_spectacular.authentication import BasicScheme, SessionScheme
from rest_framework import exceptions, status
from rest_framework.authentication import BasicAuthentication, SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed

from audit.middleware import source_ip
from audit.services import sensitive_digest
from console import access, roles
from core.errors import ApplicationError
from tenants.ratelimit import Bucket, give_back, source_network, take_all

logger = logging.getLogger("kcaas.auth")

REFUSED = "Invalid username/password."  # DRF's own wording: what every refusal of the Basic door says
THROTTLED = "Too many failed sign-in attempts. Retry later."


class TooManyAttempts(ApplicationError, exceptions.Throttled):
    """429 `too_many_attempts`: one answer whichever limit (account or source) refused, so it names neither.

    An APIException too, so DRF's request marks itself unauthenticated before the error propagates."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    code = "too_many_attempts"

    def __init__(self, retry_after_seconds: int):
        exceptions.Throttled.__init__(self, wait=retry_after_seconds, detail=THROTTLED)
        self.message, self.details = THROTTLED, {"retry_after_seconds": retry_after_seconds}  # ApplicationError's
        self.headers = {"Retry-After": str(retry_after_seconds)}


def _digest(kind: str, value: str) -> str:
    """A bucket name part: an HMAC (the audit trail's key), never the username or address itself."""
    return sensitive_digest(f"{kind}:{value}").partition(":")[2][:32]


def password_buckets(username: str, request) -> tuple[Bucket, Bucket]:
    """The REST password door's limits for one try: the account's and the source's."""
    return (
        Bucket.per_window(
            "api-password:account:" + _digest("account", username.casefold()),
            count=settings.KCAAS_API_PASSWORD_FAILURES_PER_MINUTE,
            window_seconds=60,
        ),
        Bucket.per_window(
            "api-password:source:" + _digest("source", source_network(source_ip(request))),
            count=settings.KCAAS_API_PASSWORD_FAILURES_PER_SOURCE_PER_MINUTE,
            window_seconds=60,
        ),
    )


class _FailureMemo:
    """Recently refused credentials of this process: an LRU of HMACs (process-random key) with an expiry each."""

    MAX_ENTRIES = 10_000

    def __init__(self):
        self._key = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, float] = OrderedDict()

    def key(self, *parts) -> bytes:
        return hmac.new(self._key, json.dumps(parts, separators=(",", ":")).encode(), hashlib.sha256).digest()

    def seen(self, key: bytes) -> bool:
        with self._lock:
            expires = self._entries.get(key)
            if expires is None:
                return False
            if expires < time.monotonic():
                del self._entries[key]
                return False
            self._entries.move_to_end(key)
            return True

    def add(self, key: bytes) -> None:
        ttl = float(getattr(settings, "KCAAS_PASSWORD_FAILURE_MEMO_SECONDS", 600))
        if ttl <= 0:
            return
        with self._lock:
            self._entries[key] = time.monotonic() + ttl
            self._entries.move_to_end(key)
            while len(self._entries) > self.MAX_ENTRIES:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


failure_memo = _FailureMemo()


@dataclass(frozen=True, slots=True)
class _Standing:
    """What the door knows of a username before any hash: one query, whether the user exists or not."""

    pk: object
    fingerprint: tuple
    console_user: bool  # staff with a console role, not a superuser: refused here whatever the password


def _standing(username: str) -> _Standing:
    model = get_user_model()
    console_groups = Group.objects.filter(user=OuterRef("pk"), name__in=[roles.group_name(r) for r in roles.ROLES])
    row = (
        model._default_manager.filter(**{model.USERNAME_FIELD: username})
        .annotate(kcaas_console=Exists(console_groups))
        .values_list("pk", "password", "is_active", "is_staff", "is_superuser", "kcaas_console")
        .first()
    )
    if row is None:
        return _Standing(None, ("none",), False)
    pk, password, active, staff, superuser, console = row
    # console.roles.has_console_role: staff holding a console group; a superuser keeps the API (as before)
    console_user = bool(staff and console and not superuser)
    return _Standing(pk, (str(pk), password, bool(active), console_user), console_user)


_logged: dict[str, float] = {}


def _log_throttled(bucket: Bucket, request) -> None:
    """One warning per bucket per minute (a flood of refusals must not become a flood of log lines)."""
    now = time.monotonic()
    if _logged.get(bucket.name, 0) > now:
        return
    if len(_logged) > 10_000:
        _logged.clear()
    _logged[bucket.name] = now + 60
    logger.warning("REST password door throttled: %s (source %s)", bucket.name, source_ip(request) or "unknown")


class NonConsoleSessionAuthentication(SessionAuthentication):
    def authenticate(self, request):
        if request._request.session.get(access.SESSION_FLAG):
            return None
        result = super().authenticate(request)
        if result is not None and roles.has_console_role(result[0]) and not result[0].is_superuser:
            return None
        return result


class NonConsoleBasicAuthentication(BasicAuthentication):
    def authenticate_credentials(self, userid, password, request=None):
        if "\x00" in userid:  # no such user can exist (and PostgreSQL refuses the text): a refusal, still counted
            standing = _Standing(None, ("none",), False)
        else:
            standing = _standing(userid)
        memo = failure_memo.key(userid, password, standing.fingerprint)
        if failure_memo.seen(memo):
            raise AuthenticationFailed(REFUSED)
        buckets = password_buckets(userid, request)
        taken = take_all(buckets)
        if taken is not None and not taken.allowed:
            _log_throttled(taken.refused_by, request)
            raise TooManyAttempts(taken.decision.retry_after_seconds)
        if "\x00" in userid:
            make_password(password)  # the hash ModelBackend computes for an unknown user: the same work
            user = None
        else:
            user = authenticate(request=request, username=userid, password=password)
        if user is not None and user.pk != standing.pk:  # another backend's user: ask the roles directly
            refused = roles.has_console_role(user) and not user.is_superuser
        else:
            refused = standing.console_user
        if user is None or not user.is_active or refused:
            failure_memo.add(memo)
            raise AuthenticationFailed(REFUSED)
        if taken is not None:
            give_back(buckets)
        return user, None


class NonConsoleSessionScheme(SessionScheme):
    """The published schema keeps naming these as the cookie and basic schemes they narrow."""

    target_class = "controlplane.authentication.NonConsoleSessionAuthentication"


class NonConsoleBasicScheme(BasicScheme):
    target_class = "controlplane.authentication.NonConsoleBasicAuthentication"
