"""manage.py run_kv_indexer: the KV-event indexer process (routing.indexer); SIGTERM/SIGINT end it."""

import signal

from django.core.management.base import BaseCommand

from routing.indexer import Indexer


class Command(BaseCommand):
    help = "Subscribe to the registered engine instances' KV events and keep the routing index."

    def add_arguments(self, parser):
        parser.add_argument("--health-seconds", type=float, default=2.0, help="Seconds between health checks.")

    def handle(self, *args, **options):
        indexer = Indexer(health_s=options["health_seconds"])
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: indexer.stop.set())
        self.stdout.write("kv indexer: running", ending="\n")
        self.stdout.flush()
        indexer.run()
