"""Sign-in in two steps (password, then a TOTP code; first sign-in enrols the authenticator) and sign-out.

Every refusal says the same thing whatever was wrong (unknown user, wrong password, no console role), so the page
does not tell which usernames exist; each is recorded as console.login_failed. Password tries are limited per
username (every try) and per source address (failed tries: against one password sprayed over many usernames), both
checked before the password is hashed; either limit answers the same 429 page, and the first refusal of a limit in
a minute is recorded as console.login_failed (step "throttled"). Codes are throttled by django-otp (each failure
doubles the wait before the next try).
"""

from __future__ import annotations

import base64
import math
import time

import redis
import segno
from django import forms
from django.conf import settings
from django.contrib import auth
from django.http import HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from audit.middleware import source_ip
from audit.services import AuditWriteError, sensitive_digest
from console import access, roles, sessions
from console.models import ConsoleTOTPDevice as TOTPDevice  # the seed sealed at rest (console/totp_keys.py)
from tenants.ratelimit import Bucket, bucket_key, give_back, source_network, take_all
from tenants.redis_client import get_redis

REFUSED = "Wrong username, password or code."


class PasswordForm(forms.Form):
    username = forms.CharField(
        max_length=150, widget=forms.TextInput(attrs={"autocomplete": "username", "autofocus": True})
    )
    password = forms.CharField(max_length=1024, widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}))


class CodeForm(forms.Form):
    code = forms.RegexField(
        regex=r"^\s*\d{6}\s*$",
        label="6-digit code",
        error_messages={"invalid": "Six digits."},
        widget=forms.TextInput(
            attrs={"autocomplete": "one-time-code", "inputmode": "numeric", "autofocus": True, "maxlength": 8}
        ),
    )

    def clean_code(self) -> str:
        return self.cleaned_data["code"].strip()


def _next_url(request) -> str:
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    if wanted.startswith("/console/") and url_has_allowed_host_and_scheme(wanted, allowed_hosts={request.get_host()}):
        return wanted
    return reverse("console:overview")


def _audit_down(request):
    return access.error_page(
        request,
        503,
        "Audit trail unavailable",
        "Sign-in is recorded in the audit trail, which cannot be written right now. Try again shortly.",
        "audit_unavailable",
    )


@never_cache
@require_http_methods(["GET", "POST"])
def login(request):
    if access.signed_in(request):
        return HttpResponseRedirect(_next_url(request))
    form = PasswordForm(request.POST or None)
    error = ""
    if request.method == "POST" and form.is_valid():
        username = form.cleaned_data["username"]
        buckets = _password_buckets(request, username)
        taken = take_all(buckets)
        if taken is not None and not taken.allowed:
            try:
                _record_throttled(taken.refused_by, username)
            except AuditWriteError:
                return _audit_down(request)
            wait = taken.decision.retry_after_seconds
            response = access.error_page(
                request,
                429,
                "Too many sign-in attempts",
                f"Too many sign-in attempts: wait {wait} s, then try again.",
                "rate_limited",
            )
            response["Retry-After"] = str(wait)
            return response
        user = auth.authenticate(request, username=username, password=form.cleaned_data["password"])
        if user is not None and roles.has_console_role(user):
            if taken is not None:
                give_back(buckets[1:])  # the source counts failures only; the username bucket every try
            sessions.begin_pending(request, user)
            confirmed = TOTPDevice.objects.devices_for_user(user, confirmed=True).exists()
            step = "console:verify" if confirmed else "console:enroll"
            return HttpResponseRedirect(reverse(step) + f"?next={_next_url(request)}")
        try:
            sessions.record_failure(username=username, step="password")
        except AuditWriteError:
            return _audit_down(request)
        error = REFUSED
    elif request.method == "POST":
        error = "Enter a username and a password."
    reason = request.GET.get("reason")
    notice = "Your session expired. Sign in again." if reason == "expired" else ""
    return render(
        request,
        "console/login.html",
        {"form": form, "error": error, "notice": notice, "next": _next_url(request)},
        status=400 if error else 200,
    )


def _password_buckets(request, username: str) -> tuple[Bucket, Bucket]:
    """The password step's limits, GCRA in Redis shared by every control-plane process (tenants.ratelimit): every try
    per username (KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE), and failed tries per source address (IPv6: its /64;
    X-Forwarded-For only from KCAAS_TRUSTED_PROXIES) per KCAAS_CONSOLE_SOURCE_WINDOW_SECONDS. Buckets are named by an
    HMAC of the username or address, never the text."""
    return (
        Bucket.per_window(
            "console-login:" + sensitive_digest(username.casefold()).partition(":")[2][:32],
            count=settings.KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE,
            window_seconds=60,
        ),
        Bucket.per_window(
            "console-login-source:" + _digest(source_network(source_ip(request))),
            count=settings.KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE,
            window_seconds=settings.KCAAS_CONSOLE_SOURCE_WINDOW_SECONDS,
        ),
    )


def _digest(value: str) -> str:
    return sensitive_digest(f"source:{value}").partition(":")[2][:32]


_REFUSALS_RECORDED_SECONDS = 60
_recorded_locally: dict[str, float] = {}


def _record_throttled(bucket: Bucket, username: str) -> None:
    """console.login_failed (step "throttled") for the first refusal of `bucket` in a minute: the trail shows an
    attack without every refused try becoming a write on the audit chain (the attacker's lever on everyone else)."""
    marker = bucket_key(bucket.name) + ":recorded"
    client = get_redis()
    if client is not None:
        try:
            first = client.set(marker, b"1", nx=True, ex=_REFUSALS_RECORDED_SECONDS)
        except redis.RedisError:
            first = True
    else:
        now = time.monotonic()
        first = _recorded_locally.get(marker, 0) <= now
        if first:
            if len(_recorded_locally) > 10_000:
                _recorded_locally.clear()
            _recorded_locally[marker] = now + _REFUSALS_RECORDED_SECONDS
    if first:
        sessions.record_failure(username=username, step="throttled")


def code_wait_seconds(device) -> int:
    """Whole seconds until django-otp's throttle lets `device` check a code again (rounded up); 0 when it may now."""
    allowed, data = device.verify_is_allowed()
    if allowed or not data or data.get("locked_until") is None:
        return 0
    return max(1, math.ceil((data["locked_until"] - timezone.now()).total_seconds()))


def _code_step(request, *, user, device, template: str, extra: dict):
    """Check the posted code against `device`; sign in on success (enrolment confirms the device first)."""
    form = CodeForm(request.POST or None)
    error = ""
    if request.method == "POST":
        wait = code_wait_seconds(device)
        if wait:
            error = f"Too many wrong codes: try again in {wait} s."
        elif form.is_valid() and device.verify_token(form.cleaned_data["code"]):
            if not device.confirmed:
                device.confirmed = True
                device.save(update_fields=["confirmed"])
            try:
                sessions.start_session(request, user, device)
            except AuditWriteError:
                return _audit_down(request)
            return HttpResponseRedirect(_next_url(request))
        else:
            wait = code_wait_seconds(device)  # django-otp's throttle, doubled by this failure
            error = f"{REFUSED} Try again in {wait} s." if wait else REFUSED
        try:
            sessions.record_failure(username=user.get_username(), step="code", user=user)
        except AuditWriteError:
            return _audit_down(request)
    context = {"form": form, "error": error, "next": _next_url(request), "username": user.get_username(), **extra}
    return render(request, template, context, status=400 if error else 200)


@never_cache
@require_http_methods(["GET", "POST"])
def verify(request):
    user = sessions.pending_user(request)
    device = TOTPDevice.objects.devices_for_user(user, confirmed=True).first() if user else None
    if device is None:
        return HttpResponseRedirect(reverse("console:login"))
    return _code_step(request, user=user, device=device, template="console/verify.html", extra={})


@never_cache
@require_http_methods(["GET", "POST"])
def enroll(request):
    """First sign-in: a new authenticator secret as a QR code (and as text), confirmed by its first code."""
    user = sessions.pending_user(request)
    if user is None:
        return HttpResponseRedirect(reverse("console:login"))
    if TOTPDevice.objects.devices_for_user(user, confirmed=True).exists():
        return HttpResponseRedirect(reverse("console:verify"))
    device = TOTPDevice.objects.devices_for_user(user, confirmed=False).first()
    if device is None:
        device = TOTPDevice.objects.create(user=user, name="console", confirmed=False)
    qr = segno.make(device.config_url, error="m").svg_inline(scale=4, title="Authenticator QR code")
    return _code_step(
        request,
        user=user,
        device=device,
        template="console/enroll.html",
        extra={"qr_svg": qr, "otpauth_url": device.config_url, "secret_b32": _base32(device.bin_key)},
    )


def _base32(key: bytes) -> str:
    """The secret as authenticator apps take it typed: base32, in groups of four."""
    text = base64.b32encode(key).decode().rstrip("=")
    return " ".join(text[i : i + 4] for i in range(0, len(text), 4))


@never_cache
@require_http_methods(["POST"])
def logout(request):
    sessions.end_session(request, reason="signed_out")
    return HttpResponseRedirect(reverse("console:login"))
