"""Console forms: validation of what an operator types, before any service is called.

A form that is not valid changes nothing (its view answers 400 with the errors next to the fields). The bounds are
the services' own (tenants.services.QUOTA_BOUNDS), so a value this form accepts is one the service accepts.
"""

from __future__ import annotations

import re

from django import forms

from tenants.quota_values import BYTE_FIELDS, BYTE_UNITS, QuotaValueError, quota_value_parse, string_pattern
from tenants.scopes import ALL_SCOPES
from tenants.services import KEY_NAME_MAX_LENGTH, QUOTA_BOUNDS, TENANT_NAME_MAX_LENGTH

QUOTA_LABELS = {
    "max_caches": "Caches",
    "max_device_bytes": "Device bytes",
    "max_dram_bytes": "DRAM bytes",
    "max_ssd_bytes": "SSD bytes",
    "max_network_bytes": "Network bytes",
    "max_requests_per_second": "Requests per second",
    "max_data_tokens_outstanding": "Data tokens outstanding",
    "max_api_keys": "API keys",
}
_WHOLE_NUMBER = re.compile(r"^(?:0|[1-9][0-9]{0,39})$")


class TenantSearchForm(forms.Form):
    """?q= on the tenants list: part of a name, or a tenant id. NUL and over-long input are refused (400)."""

    q = forms.CharField(required=False, max_length=100, label="Name or id")


def bytes_text(count: int, field: str = "max_device_bytes") -> str:
    """The exact form of a byte count an operator would type: "16 GiB" when a whole number of a binary unit that the
    field's parser takes back (tenants.quota_values), else the plain integer (parses back to the same number)."""
    pattern = re.compile(string_pattern(field, QUOTA_BOUNDS[field]))
    for unit in ("PiB", "TiB", "GiB", "MiB"):
        size = BYTE_UNITS[unit.lower()]
        if count and count % size == 0 and pattern.match(f"{count // size} {unit}"):
            return f"{count // size} {unit}"
    return str(count)


def limit_text(field: str, value: int) -> str:
    """A limit as an operator would type it: bytes fields by bytes_text, the others as plain integers."""
    return bytes_text(value, field) if field in BYTE_FIELDS else str(value)


def parse_limit(field: str, text: str) -> int | None:
    """A quota limit as typed: blank -> None (the default); else what the REST API takes for it, parsed by the same
    parser (tenants.quota_values: a whole number, bytes fields optionally with KiB, MiB, GiB, TiB or PiB, within
    QUOTA_BOUNDS[field]); a form's digits are a number, as a JSON integer is. Anything else raises
    forms.ValidationError."""
    text = (text or "").strip()
    if not text:
        return None
    value: int | str = int(text) if _WHOLE_NUMBER.match(text) else text
    try:
        return quota_value_parse(field, value, bounds=QUOTA_BOUNDS[field])
    except QuotaValueError as error:
        raise forms.ValidationError(f"{error} Or blank for the default.") from None


class QuotaForm(forms.Form):
    """The quota limits (QUOTA_BOUNDS), each blank (the default) or a bounded integer; cleaned_data maps field -> int
    | None."""

    def __init__(self, *args, defaults: dict[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        defaults = defaults or {}
        for field in QUOTA_BOUNDS:
            default = defaults.get(field)
            shown = "" if default is None else limit_text(field, default)
            hint = f"Blank: the default ({shown})." if shown else "Blank: the default."
            if field in BYTE_FIELDS:
                hint += " Bytes, or a number with KiB, MiB, GiB, TiB or PiB."
            self.fields[field] = forms.CharField(
                required=False, max_length=64, label=QUOTA_LABELS[field], help_text=hint, strip=True
            )

    @staticmethod
    def initial_from(overrides: dict[str, int | None]) -> dict[str, str]:
        """What the form shows for the stored overrides (None: blank)."""
        return {field: "" if value is None else limit_text(field, value) for field, value in overrides.items()}

    def clean(self):
        cleaned = super().clean()
        for field in QUOTA_BOUNDS:
            if field in self._errors:
                continue
            try:
                cleaned[field] = parse_limit(field, cleaned.get(field, ""))
            except forms.ValidationError as error:
                self.add_error(field, error)
        return cleaned


class TenantCreateForm(QuotaForm):
    """A new tenant: its name, and its initial quota limits (QuotaForm's fields, blank: the default). The name's
    characters and uniqueness are the service's to check (tenants.services.tenant_create); its errors are put on the
    field by the view."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name = forms.CharField(
            max_length=TENANT_NAME_MAX_LENGTH,
            label="Name",
            help_text=f"Unique; at most {TENANT_NAME_MAX_LENGTH} characters. The tenant's developers see it.",
            strip=True,
        )
        self.fields = {"name": name, **self.fields}

    def quota(self) -> dict[str, int | None]:
        """The limits typed, for tenants.services.tenant_create(quota=...) (None: the default)."""
        return {field: self.cleaned_data[field] for field in QUOTA_BOUNDS}


KEY_LIFETIME_MAX_DAYS = 5 * 366  # the REST API's longest lifetime (tenants.apis.MAX_KEY_LIFETIME_SECONDS)
SCOPE_CHOICES = [(scope, scope) for scope in ALL_SCOPES]


class ApiKeyIssueForm(forms.Form):
    """A new API key for a tenant, as POST /api/v1/keys takes it: a name (optional), its scopes (at least one of
    tenants.scopes.ALL_SCOPES; write implies read), and an optional lifetime in whole days (blank: it never
    expires). `nonce` is the one-time token of this form (console.pages.tenant_onboarding): a resubmission issues
    nothing."""

    name = forms.CharField(
        required=False,
        max_length=KEY_NAME_MAX_LENGTH,
        label="Name",
        help_text="Optional: where the key is used, e.g. “prod engines”.",
        strip=True,
    )
    scopes = forms.MultipleChoiceField(
        choices=SCOPE_CHOICES,
        label="Scopes",
        help_text="What the key may do; write includes read. An engine needs caches:write.",
        error_messages={"required": "Choose at least one scope."},
    )
    expires_in_days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=KEY_LIFETIME_MAX_DAYS,
        label="Expires after (days)",
        help_text=f"Blank: never (revoke or rotate it instead). At most {KEY_LIFETIME_MAX_DAYS} days.",
    )
    nonce = forms.CharField(max_length=64, required=False)
