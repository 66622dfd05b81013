"""Console pages: the audit trail (events with filters), a verifiable export, and a verifier for uploaded exports.

- Events (`console:audit`, every role): filters in the query string (a GET form, pre-filled from the URL, kept by
  the pager and by each row's actor, tenant and target links), validated by a Django form (bad values are a 400 with
  the form's errors), then exactly the REST list's read (`audit.queries.audit_event_list`, plus a target filter),
  newest first, 50 a page. Names beside the ids come from `console.audit_names` (one query per kind of object for the
  whole page; a deleted or erased object is its id and "(deleted)").
- Export (`console:audit_export`, capability audit.export): GET shows the form, POST (CSRF) streams the export
  through `audit.exports.audit_export_begin` + `export_response`, the function the REST export calls, so the
  records, digests, platform key and the AUDIT_EXPORTED event (actor user:<pk>) are the same.
- Verify (`console:audit_verify`, capability audit.export): an uploaded export checked by
  `audit.chain.verify_export` against the platform's own public key. The upload is refused above
  `KCAAS_CONSOLE_AUDIT_VERIFY_MAX_BYTES` (413) before it is read into memory, and nothing uploaded is stored.
All times on these pages are UTC (the datetime-local inputs are read as UTC).
"""

from __future__ import annotations

import json
from datetime import UTC

from django import forms
from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.core.paginator import Paginator
from django.shortcuts import render
from django.urls import path
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from audit import chain, exports, queries
from audit.actions import AuditAction
from audit.apis import ACTOR_PATTERN
from audit.context import ACTOR_KINDS
from audit.keys import platform_public_jwk
from console.access import console_view, error_page, page_context
from console.audit_names import audit_names
from core.ids import as_uuid
from tenants.selectors import tenant_by_name_or_id

PAGE_SIZE = 50
DEFAULT_VERIFY_MAX_BYTES = 64 * 1024 * 1024
MULTIPART_SLACK = 64 * 1024  # boundaries and the CSRF field around the file in a multipart body
MAX_PROBLEMS_SHOWN = 500
FILTER_KEYS = ("from", "to", "tenant", "actor", "action", "target")
TARGET_PATTERN = r"^[a-z_]{1,40}(:[!-~]{1,200})?$"


# ---- forms -----------------------------------------------------------------------------------------------------------


class UtcDateTimeField(forms.DateTimeField):
    """A datetime-local input read as UTC (a time with an explicit offset keeps it)."""

    widget = forms.DateTimeInput(attrs={"type": "datetime-local", "step": "1"}, format="%Y-%m-%dT%H:%M:%S")

    def to_python(self, value):
        with timezone.override(UTC):
            return super().to_python(value)


class TenantField(forms.CharField):
    """A tenant id (any UUID: an erased tenant's events keep their pseudonymous id) or an existing tenant's exact
    name, resolved to its id; an unknown name is an error, never a silently empty result."""

    def __init__(self, **kwargs):
        super().__init__(required=False, max_length=100, strip=True, **kwargs)

    def clean(self, value):
        text = super().clean(value)
        if not text:
            return None
        wanted = as_uuid(text)
        if wanted is not None:
            return wanted
        tenant = tenant_by_name_or_id(text=text)
        if tenant is None:
            raise forms.ValidationError("No such tenant: give a tenant id (UUID) or an existing tenant's exact name.")
        return tenant.pk


def _range_fields() -> dict:
    return {
        "from": UtcDateTimeField(required=False, label="From (UTC, inclusive)"),
        "to": UtcDateTimeField(required=False, label="To (UTC, exclusive)"),
    }


class RangeForm(forms.Form):
    """[from, to) in UTC, from before to; subclasses add their fields after these two."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields = {**_range_fields(), **self.fields}

    def clean(self):
        data = super().clean()
        start, end = data.get("from"), data.get("to")
        if start is not None and end is not None and start >= end:
            self.add_error("to", "“To” must be after “From”.")
        return data


ACTOR_INVALID = (
    "An actor is `kind` or `kind:id`, with kind one of "
    + ", ".join(ACTOR_KINDS)
    + " (e.g. user:7, key:<public id>, system)."
)
ACTION_CHOICES = [("", "Any action")] + sorted((a.code_name, a.code_name) for a in AuditAction)
ACTION_BY_NAME = {a.code_name: a for a in AuditAction}


class EventFilterForm(RangeForm):
    """The REST list's filters: range, tenant, actor (its ACTOR_PATTERN), action (by its name, as the table shows
    it: `tenant.created`, not its numeric code)."""

    tenant = TenantField(label="Tenant (id or name)")
    actor = forms.RegexField(
        ACTOR_PATTERN,
        required=False,
        max_length=210,
        label="Actor (kind or kind:id)",
        error_messages={"invalid": ACTOR_INVALID},
    )
    action = forms.TypedChoiceField(
        choices=ACTION_CHOICES,
        coerce=ACTION_BY_NAME.__getitem__,
        empty_value=None,
        required=False,
        label="Action",
        error_messages={"invalid_choice": "Choose an action from the list (a name such as tenant.created)."},
    )
    target = forms.RegexField(
        TARGET_PATTERN,
        required=False,
        max_length=241,
        label="Target (type or type:id)",
        error_messages={"invalid": "A target is `type` or `type:id` (e.g. node, cache:<id>, api_key:<id>)."},
    )


class ExportForm(RangeForm):
    format = forms.ChoiceField(
        choices=[("jsonl", "JSONL (one JSON record a line)"), ("csv", "CSV")], initial="jsonl", label="Format"
    )
    tenant = TenantField(label="Tenant (id or name; empty: every tenant)")

    def clean(self):
        data = super().clean()
        start, end = data.get("from"), data.get("to")
        if start is not None and end is None and start >= timezone.now():
            self.add_error("from", "“From” must be in the past when “To” is empty (the export ends now).")
        return data


class VerifyForm(forms.Form):
    export = forms.FileField(
        label="Export file (JSONL or CSV)",
        allow_empty_file=False,
        error_messages={
            "empty": "The file is empty: it is not an export.",
            "required": "Choose an export file to verify.",
        },
    )


# ---- events ----------------------------------------------------------------------------------------------------------


@console_view()
def index(request):
    """The trail, filtered as the REST list filters it (and by target), newest first; bad filters are a 400 with the
    form errors. The names beside the ids come from one query per kind of object for the whole page."""
    form = EventFilterForm(request.GET)
    context = page_context(request, title="Audit events", section="audit", form=form, page=None, rows=[])
    if not form.is_valid():
        return render(request, "console/audit/events.html", context, status=400)
    filters = form.cleaned_data
    kind, _, actor_id = (filters["actor"] or "").partition(":")
    events = queries.audit_event_list(
        start=filters["from"],
        end=filters["to"],
        tenant_id=filters["tenant"],
        actor_kind=kind or None,
        actor_id=actor_id or None,
        action=filters["action"],
    )
    target_type, _, target_id = (filters["target"] or "").partition(":")
    if target_type:
        events = events.filter(target_type=target_type)
    if target_id:
        events = events.filter(target_id=target_id)
    page = Paginator(events.reverse(), PAGE_SIZE).get_page(request.GET.get("page"))
    names = audit_names(page)
    query = _filter_query(request.GET)
    context.update(
        listed=True,
        page=page,
        rows=[_row(event, names, request.GET) for event in page],
        query=query,
        filtered=bool(query),
        export_query=_filter_query(request.GET, keys=("from", "to", "tenant")),
    )
    return render(request, "console/audit/events.html", context)


def _filter_query(params, keys=FILTER_KEYS, **replaced: str) -> str:
    """The filters of `params` that are set, with `replaced` ones swapped in, urlencoded (pager links, the export
    link and the links of a row's actor, tenant and target keep them)."""
    values = {key: params.get(key, "") for key in keys} | replaced
    return urlencode([(key, value) for key, value in values.items() if value])


def _row(event, names, params) -> dict:
    try:
        action_name = AuditAction(event.action).code_name
    except ValueError:
        action_name = f"unknown ({event.action})"
    actor, tenant, target = names.actor(event), names.tenant(event), names.target(event)
    return {
        "event": event,
        "actor": actor,
        "action_name": action_name,
        "tenant": tenant,
        "target": target,
        "actor_query": _filter_query(params, actor=actor.full),
        "tenant_query": _filter_query(params, tenant=tenant.id) if tenant else "",
        "target_query": _filter_query(params, target=target.full),
        "old": _json(event.old_values),
        "new": _json(event.new_values),
        "changed": event.old_values is not None or event.new_values is not None,
    }


def _json(values) -> str:
    return "—" if values is None else json.dumps(values, indent=2, sort_keys=True, ensure_ascii=False)


# ---- export ----------------------------------------------------------------------------------------------------------


@console_view("audit.export", methods=("GET", "POST"))
def export(request):
    """GET: the form (prefilled from the events page's range and tenant). POST: the recorded, streamed export."""
    if request.method != "POST":  # GET or HEAD
        initial = {key: request.GET[key] for key in ("from", "to", "tenant") if request.GET.get(key)}
        return _export_form(request, ExportForm(initial={"format": "jsonl", **initial}))
    form = ExportForm(request.POST)
    if not form.is_valid():
        return _export_form(request, form, status=400)
    data = form.cleaned_data
    download = exports.audit_export_begin(
        fmt=data["format"], start=data["from"], end=data["to"], tenant_id=data["tenant"]
    )
    return exports.export_response(download)


def _export_form(request, form, status: int = 200):
    context = page_context(request, title="Export the audit trail", section="audit", form=form)
    return render(request, "console/audit/export.html", context, status=status)


# ---- verify ----------------------------------------------------------------------------------------------------------


def verify_max_bytes() -> int:
    return int(getattr(settings, "KCAAS_CONSOLE_AUDIT_VERIFY_MAX_BYTES", DEFAULT_VERIFY_MAX_BYTES))


class UploadLimit(FileUploadHandler):
    """First upload handler: stops a file once it passes `limit` bytes (the rest of the body is discarded unread
    into any file) and remembers that it did."""

    def __init__(self, limit: int, request=None):
        super().__init__(request)
        self.limit, self.exceeded = limit, False

    def receive_data_chunk(self, raw_data, start):
        if start + len(raw_data) > self.limit:
            self.exceeded = True
            raise StopUpload(connection_reset=False)
        return raw_data

    def file_complete(self, file_size):
        return None  # the next handler builds the file


@csrf_exempt  # checked in `_verify_post`, once the size limit is installed (reading the token parses the body)
@console_view("audit.export", methods=("GET", "POST"))
def verify(request):
    """GET: the upload form. POST: the verification of the uploaded export against the platform key."""
    if request.method != "POST":  # GET or HEAD
        return _verify_page(request, VerifyForm())
    limit = verify_max_bytes()
    declared = _content_length(request)
    if declared is not None and declared > limit + MULTIPART_SLACK:
        return _too_large(request, limit)
    guard = UploadLimit(limit, request)
    request.upload_handlers.insert(0, guard)
    return _verify_post(request, guard, limit)


@csrf_protect
def _verify_post(request, guard: UploadLimit, limit: int):
    form = VerifyForm(request.POST, request.FILES)
    if guard.exceeded:
        return _too_large(request, limit)
    if not form.is_valid():
        return _verify_page(request, form, status=400)
    upload = form.cleaned_data["export"]
    result = verification_of(upload.read(), trusted_key=platform_public_jwk())
    return _verify_page(request, VerifyForm(), result={**result, "name": upload.name, "size": upload.size})


def _content_length(request) -> int | None:
    try:
        return int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None


def _too_large(request, limit: int):
    return error_page(
        request,
        413,
        "File too large",
        f"The export is larger than the {_size(limit)} this page verifies. Verify it offline with "
        "`python audit/chain.py verify FILE --key platform-key.json`.",
        "file_too_large",
    )


def _size(count: int) -> str:
    return f"{count / 1024 / 1024:g} MiB" if count >= 1024 * 1024 else f"{count} bytes"


def verification_of(data: bytes, *, trusted_key: dict) -> dict:
    """The report of `data` as an export verified against `trusted_key`, and the problem that breaks the chain first
    (the lowest seq named by a problem). Text that is not UTF-8, or too deeply nested to parse, is a `malformed`
    problem: never an exception."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        report = chain.Report()
        report.add("malformed", f"the file is not UTF-8 text (invalid byte at offset {error.start})")
    else:
        try:
            report = chain.verify_export([text], trusted_key_jwk=trusted_key)
        except RecursionError:
            report = chain.Report()
            report.add("malformed", "the file nests JSON too deeply to be an export")
    with_seq = [problem for problem in report.problems if problem.seq is not None]
    return {
        "report": report,
        "first_break": min(with_seq, key=lambda problem: problem.seq) if with_seq else None,
        "problems": report.problems[:MAX_PROBLEMS_SHOWN],
        "problems_hidden": max(0, len(report.problems) - MAX_PROBLEMS_SHOWN),
        "key_id": trusted_key.get("kid", ""),
    }


def _verify_page(request, form, *, status: int = 200, result: dict | None = None):
    context = page_context(
        request,
        title="Verify an audit export",
        section="audit",
        form=form,
        result=result,
        max_size=_size(verify_max_bytes()),
        key_id=platform_public_jwk()["kid"],
    )
    return render(request, "console/audit/verify.html", context, status=status)


urlpatterns = [
    path("", index, name="audit"),
    path("export", export, name="audit_export"),
    path("verify", verify, name="audit_verify"),
]
