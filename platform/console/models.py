"""The console's one model: its TOTP device, a django-otp device whose seed is sealed at rest.

django-otp's own TOTPDevice keeps its seed (`key`) as plain hex in the database; `ConsoleTOTPDevice` is the same
device (same fields, throttling, timestamps, the same verification code: TOTPDevice's methods are reused as they
are) with the seed in `key_sealed`, AES-256-GCM under the platform KEK bound to the user (console/totp_keys.py).
The seed exists in clear only in memory, while a code is checked or the enrolment QR code is drawn.

Invariants: `key_sealed` is never empty once saved (a new device gets a fresh 160-bit seed at its first save); the
row moves to another user only by enrolling anew (the seed of one user does not open for another); migration
console.0002 sealed every otp_totp.TOTPDevice into this table and deleted the clear rows.
"""

from __future__ import annotations

import logging
from binascii import hexlify

from django.db import models
from django_otp.models import Device, ThrottlingMixin, TimestampMixin
from django_otp.plugins.otp_totp.models import TOTPDevice

from console.totp_keys import TotpKeyError, new_sealed_seed, totp_key_unseal

logger = logging.getLogger("kcaas.console")


class ConsoleTOTPDevice(TimestampMixin, ThrottlingMixin, Device):
    key_sealed = models.BinaryField(help_text="The seed, sealed under the KEK for this user (console/totp_keys.py).")
    step = models.PositiveSmallIntegerField(default=30, help_text="The time step in seconds.")
    t0 = models.BigIntegerField(default=0, help_text="The Unix time at which to begin counting steps.")
    digits = models.PositiveSmallIntegerField(
        choices=[(6, 6), (8, 8)], default=6, help_text="The number of digits to expect in a token."
    )
    tolerance = models.PositiveSmallIntegerField(default=1, help_text="Time steps in the past or future to allow.")
    drift = models.SmallIntegerField(default=0, help_text="Time steps the prover is known to deviate from our clock.")
    last_t = models.BigIntegerField(default=-1, help_text="The time step of the last verified token.")

    class Meta(Device.Meta):
        verbose_name = "console TOTP device"

    def save(self, *args, **kwargs):
        if not self.key_sealed:
            self.key_sealed = new_sealed_seed(user_id=self.user_id)
        super().save(*args, **kwargs)

    @property
    def bin_key(self) -> bytes:
        """The seed, unsealed; TotpKeyError when it does not open (the wrong KEK, a row moved to another user)."""
        return totp_key_unseal(user_id=self.user_id, sealed=bytes(self.key_sealed or b""))

    @property
    def key(self) -> str:
        """The seed as django-otp's hex, for code written against TOTPDevice; never stored."""
        return hexlify(self.bin_key).decode()

    def verify_token(self, token) -> bool:
        """django-otp's TOTP verification (drift, replay guard, throttling); a seed that does not open verifies
        nothing (logged), it never raises into the sign-in page."""
        try:
            self.bin_key  # noqa: B018 - the property raises TotpKeyError for a seed that does not open
        except TotpKeyError:
            logger.error("console TOTP device %s: its seed does not open under this KEK", self.pk)
            return False
        return TOTPDevice.verify_token(self, token)

    # django-otp's TOTP logic as it is (throttling, the otpauth:// URL); they read the seed through `bin_key` only.
    get_throttle_factor = TOTPDevice.get_throttle_factor
    config_url = TOTPDevice.config_url
    _read_str_from_settings = TOTPDevice._read_str_from_settings
