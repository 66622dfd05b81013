"""Create or update a console user:
`manage.py console_user NAME --role operator [--role compliance] [--password-file F]`.

The user is staff with the given console roles (groups `console:<role>`); the password comes from --password-file,
the KCAAS_CONSOLE_PASSWORD variable, or is generated and printed. The authenticator is enrolled at first sign-in
(the console shows a QR code); `--reset-otp` forgets the enrolled one. Printed as one JSON line with --json.
"""

from __future__ import annotations

import json
import os
import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django_otp.plugins.otp_totp.models import TOTPDevice

from console import roles
from console.models import ConsoleTOTPDevice


class Command(BaseCommand):
    help = "Create or update a staff user of the web console with its roles."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", action="append", choices=roles.ROLES, required=True, dest="role_names")
        parser.add_argument("--password-file", help="read the password from this file (first line)")
        parser.add_argument("--reset-otp", action="store_true", help="forget the enrolled authenticator")
        parser.add_argument("--json", action="store_true", dest="as_json")

    def handle(self, *args, username, role_names: list[str], password_file, reset_otp, as_json: bool, **options):
        password, generated = self._password(password_file)
        with transaction.atomic():
            user, created = get_user_model().objects.get_or_create(username=username)
            user.is_staff = True
            if password is not None:
                user.set_password(password)
            user.save()
            user.groups.remove(*Group.objects.filter(name__startswith=roles.GROUP_PREFIX))
            user.groups.add(*(Group.objects.get_or_create(name=roles.group_name(r))[0] for r in role_names))
            if reset_otp:
                ConsoleTOTPDevice.objects.filter(user=user).delete()
                TOTPDevice.objects.filter(user=user).delete()  # a clear one left by an older version, if any
        result = {
            "username": username,
            "created": created,
            "roles": sorted(role_names),
            "password": password if generated else None,
        }
        self.stdout.write(json.dumps(result) if as_json else self._text(result))

    def _password(self, path) -> tuple[str | None, bool]:
        if path:
            try:
                with open(path, encoding="utf-8") as handle:
                    text = handle.readline().rstrip("\n")
            except OSError as error:
                raise CommandError(f"cannot read {path}: {error}") from error
            if not text:
                raise CommandError(f"{path} holds no password")
            return text, False
        if os.environ.get("KCAAS_CONSOLE_PASSWORD"):
            return os.environ["KCAAS_CONSOLE_PASSWORD"], False
        return secrets.token_urlsafe(18), True

    @staticmethod
    def _text(result: dict) -> str:
        lines = [
            f"{'created' if result['created'] else 'updated'} console user {result['username']} "
            f"({', '.join(result['roles'])})"
        ]
        if result["password"]:
            lines.append(f"password: {result['password']}")
        lines.append("sign in at /console/login; the first sign-in enrols an authenticator app")
        return "\n".join(lines)
