"""``manage.py kcaas_local_admin USERNAME --password-file PATH``: the staff login `make up` prints.

Creates the staff user once with a random password kept in PATH (0600); later runs reuse it. Prints the password.
"""

import os
import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Ensure a local staff user exists and print its password."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--password-file", required=True)

    def handle(self, *args, username, password_file, **options):
        path = Path(password_file)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(18))
            os.chmod(path, 0o600)
        password = path.read_text().strip()
        user, _ = get_user_model().objects.get_or_create(username=username, defaults={"is_staff": True})
        user.is_staff = True
        user.set_password(password)
        user.save()
        self.stdout.write(password)
