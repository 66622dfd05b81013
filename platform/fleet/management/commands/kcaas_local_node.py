"""``manage.py kcaas_local_node NAME --credential-file PATH``: the node `make up` runs on this machine.

Creates the node the first time and writes its credential (shown once by the service) to PATH (0600); later runs
find the node and the file and reuse them. Prints the credential on stdout.
"""

import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from fleet import services
from fleet.models import Node


class Command(BaseCommand):
    help = "Create (once) the local node for make up and print its credential."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--credential-file", required=True)

    def handle(self, *args, name, credential_file, **options):
        path = Path(credential_file)
        exists = Node.objects.filter(name=name).exists()
        if exists and path.exists():
            self.stdout.write(path.read_text().strip())
            return
        if exists:
            raise CommandError(f"node {name} exists but its credential file {path} is gone: remove the node first")
        issued = services.node_create(name=name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(issued.credential)
        os.chmod(path, 0o600)
        self.stderr.write(f"created node {name} ({issued.node.pk})")
        self.stdout.write(issued.credential)
