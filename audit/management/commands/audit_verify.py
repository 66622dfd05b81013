"""`manage.py audit_verify EXPORT [--key JWK_FILE]`: verify an audit export (JSONL or CSV) with audit/chain.py.

By default the digests must be signed by this platform's own key (audit.keys.platform_public_jwk); `--key` pins
another (e.g. a key published before a rotation). Prints a one-line summary and the first problems; exits 0 when
everything verifies, 1 otherwise.
"""

import json

from django.core.management.base import BaseCommand, CommandError

from audit import chain
from audit.keys import platform_public_jwk


class Command(BaseCommand):
    help = "Verify an audit export (JSONL or CSV) offline: chain, commitments, digests and their signatures."

    def add_arguments(self, parser):
        parser.add_argument("export", help="the export file")
        parser.add_argument("--key", help="a trusted platform public key (JWK file); default: this platform's key")
        parser.add_argument("--max-problems", type=int, default=20)

    def handle(self, *args, **options):
        trusted = platform_public_jwk()
        if options["key"]:
            with open(options["key"], encoding="utf-8") as f:
                trusted = json.load(f)
        try:
            report = chain.verify_export(options["export"], trusted_key_jwk=trusted)
        except OSError as error:
            raise CommandError(f"cannot read {options['export']}: {error}", returncode=2) from error
        for line in chain.report_lines(report, max_problems=options["max_problems"]):
            self.stdout.write(line)
        if not report.ok:
            raise CommandError(f"the export does not verify ({len(report.problems)} problems)", returncode=1)
