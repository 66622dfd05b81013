"""Starting and ending console sessions, each recorded in the audit trail (console.login, console.logout,
console.login_failed). Recording fails closed: a sign-in whose event cannot be written does not happen."""

from __future__ import annotations

import logging
import time

import django_otp
from django.contrib import auth
from django.db import transaction

from audit.actions import AuditAction
from audit.context import Actor
from audit.services import AuditWriteError, audit_record
from console import access, roles

STARTED, LAST_SEEN = "kcaas_console_started", "kcaas_console_last_seen"
PENDING_USER, PENDING_AT = "kcaas_console_pending_user", "kcaas_console_pending_at"
PENDING_SECONDS = 300  # between the password and the code
log = logging.getLogger(__name__)


def _user_actor(user) -> Actor:
    return Actor("user", str(user.pk))


def record_failure(*, username: str, step: str, user=None) -> None:
    """A refused password or code. The attempted username enters the trail only as an HMAC (it may be a password
    typed in the wrong box)."""
    with transaction.atomic():
        audit_record(
            action=AuditAction.CONSOLE_LOGIN_FAILED,
            target_type="console_user",
            target_id=str(user.pk) if user is not None else "",
            new={"username": username, "step": step},
            sensitive={"username"},
            actor=_user_actor(user) if user is not None else None,
        )


def begin_pending(request, user) -> None:
    """The password was right: remember who is half signed in, under a fresh session key."""
    request.session.cycle_key()
    request.session[PENDING_USER] = user.pk
    request.session[PENDING_AT] = time.time()


def pending_user(request):
    user_id, at = request.session.get(PENDING_USER), request.session.get(PENDING_AT, 0)
    if user_id is None or time.time() - at > PENDING_SECONDS:
        return None
    user = auth.get_user_model().objects.filter(pk=user_id, is_active=True).first()
    return user if user is not None and roles.has_console_role(user) else None


def start_session(request, user, device) -> None:
    """Password and code both right: sign in (a new session key), mark the session as the console's."""
    with transaction.atomic():
        audit_record(
            action=AuditAction.CONSOLE_LOGIN,
            target_type="console_user",
            target_id=str(user.pk),
            new={"roles": sorted(roles.user_roles(user)), "device": device.persistent_id},
            actor=_user_actor(user),
        )
    auth.login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    django_otp.login(request, device)
    now = time.time()
    request.session[access.SESSION_FLAG] = True
    request.session[STARTED] = now
    request.session[LAST_SEEN] = now


def end_session(request, *, reason: str) -> None:
    """Sign out, always: ending access never waits on the trail (a failed record is logged, not raised)."""
    user = request.user
    if user.is_authenticated:
        try:
            with transaction.atomic():
                audit_record(
                    action=AuditAction.CONSOLE_LOGOUT,
                    target_type="console_user",
                    target_id=str(user.pk),
                    new={"reason": reason},
                    actor=_user_actor(user),
                )
        except AuditWriteError:
            log.warning("console.logout of user %s (%s) could not be recorded", user.pk, reason)
    auth.logout(request)
