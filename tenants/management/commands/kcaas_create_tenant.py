"""``manage.py kcaas_create_tenant NAME [--scopes ...] [--reuse] [--replace]``: create a tenant and print a fresh
API key. ``--replace`` revokes the tenant's earlier active keys of the same ``--key-name`` first, so a command run
at every start (``make up``) never piles up keys against the tenant's ``max_api_keys`` quota.

The raw key is the only thing written to stdout (so ``KEY=$(manage.py kcaas_create_tenant demo)`` works); what was
done goes to stderr. ``make up`` uses it for the demo tenant.
"""

from django.core.management.base import BaseCommand, CommandError

from core.errors import ApplicationError
from tenants import scopes as scope_rules
from tenants import services
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create a tenant (or reuse one with --reuse) and print a new API key for it."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--scopes",
            nargs="+",
            default=list(scope_rules.ALL_SCOPES),
            choices=scope_rules.ALL_SCOPES,
            help="Scopes of the key (default: all).",
        )
        parser.add_argument("--key-name", default="created by kcaas_create_tenant")
        parser.add_argument("--reuse", action="store_true", help="Use the tenant of that name if it exists.")
        parser.add_argument(
            "--replace",
            action="store_true",
            help="Revoke the tenant's active keys of the same --key-name before issuing the new one.",
        )

    def handle(self, *args, name, scopes, key_name, reuse, replace=False, **options):
        tenant = Tenant.objects.filter(name=name.strip()).first() if reuse else None
        try:
            if tenant is None:
                tenant = services.tenant_create(name=name)
                self.stderr.write(f"created tenant {tenant.name} ({tenant.pk})")
            else:
                self.stderr.write(f"reusing tenant {tenant.name} ({tenant.pk})")
            if replace:
                for old in tenant.api_keys.filter(name=key_name, revoked_at__isnull=True):
                    services.api_key_revoke(api_key=old)
                    self.stderr.write(f"revoked the earlier key {old.public_id}")
            issued = services.api_key_issue(tenant=tenant, scopes=scopes, name=key_name)
        except ApplicationError as exc:
            raise CommandError(f"{exc.code}: {exc.message} {exc.details or ''}".strip()) from None
        self.stderr.write(f"key {issued.api_key.public_id} scopes {' '.join(issued.api_key.scopes)}")
        self.stdout.write(issued.raw_key)
