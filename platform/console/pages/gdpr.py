"""Console pages: GDPR — erasure jobs (Art. 17) and portability exports (Art. 20).

Invariants:
- no logic of its own: requests, cancels, receipts and exports call exactly what the privacy REST views call
  (privacy.services.erasure_request / erasure_cancel, privacy.receipt.receipt_envelope, privacy.export.tenant_export),
  so the services write the audit events, with the signed-in console user as the actor (`user:<pk>`);
- every change is a POST by a user holding `gdpr.edit`; an erasure request needs the tenant's name typed on its
  confirmation step (a mismatch changes nothing and answers 400); a refusal of a service (404, 409) is shown with its
  own status and nothing changes;
- tenants are named as privacy.selectors.erasure_tenant_labels names them: never data that the erasure removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils import timezone
from django.utils.text import slugify

from console.access import console_view, page_context
from core.errors import NotFoundError
from privacy import export, receipt, selectors, services
from privacy.models import CANCELLABLE_STATES, ErasureJob, ErasureState
from tenants.models import Tenant
from tenants.selectors import tenant_by_name_or_id, tenant_get

PAGE_SIZE = 25
SECTION = {"section": "gdpr"}


class TenantChoiceForm(forms.Form):
    """A tenant named by its exact name or its id; `cleaned_data["tenant"]` is the Tenant."""

    tenant = forms.CharField(label="Tenant name or id", max_length=200, strip=True)

    def clean_tenant(self) -> Tenant:
        tenant = tenant_by_name_or_id(text=self.cleaned_data["tenant"])
        if tenant is None:
            raise forms.ValidationError("No tenant has this name or id.")
        return tenant


@dataclass(frozen=True)
class JobRow:
    job: ErasureJob
    tenant: str  # the tenant's label (its pseudonymous name once erased)
    receipt_verifies: bool | None  # None: no receipt yet
    requested_by: str  # "alice (user:7)" for a console or staff user; the stored actor otherwise

    @property
    def cancellable(self) -> bool:
        return self.job.state in CANCELLABLE_STATES


def _jobs_context(request) -> dict:
    page = Paginator(selectors.erasure_job_list(), PAGE_SIZE).get_page(request.GET.get("page"))
    labels = selectors.erasure_tenant_labels(tenant_ids=[job.tenant_id for job in page])
    requesters = _requester_labels([job.requested_by for job in page])
    rows = [
        JobRow(
            job=job,
            tenant=labels.get(job.tenant_id, ""),
            requested_by=requesters[job.requested_by],
            receipt_verifies=selectors.erasure_receipt_verifies(job=job) if job.receipt is not None else None,
        )
        for job in page
    ]
    return {"page": page, "rows": rows, "query": ""}


def _requester_labels(actors: list[str]) -> dict[str, str]:
    """Staff actors ("user:<pk>") named by their username next to the id; anything else as stored."""
    pks = {int(actor[5:]) for actor in actors if actor.startswith("user:") and actor[5:].isdigit()}
    names = dict(get_user_model().objects.filter(pk__in=pks).values_list("pk", "username"))

    def label(actor: str) -> str:
        kind, _, ident = actor.partition(":")
        known = kind == "user" and ident.isdigit() and int(ident) in names
        return f"{names[int(ident)]} ({actor})" if known else actor

    return {actor: label(actor) for actor in actors}


def _label(tenant_id) -> str:
    return selectors.erasure_tenant_labels(tenant_ids=[tenant_id]).get(tenant_id, str(tenant_id))


def _duration(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600} hour" + ("" if seconds == 3600 else "s")
    return f"{seconds} s"


def _when(moment) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M UTC") if moment else "—"


# ---- the jobs page and its live table --------------------------------------------------------------------------------


def _page(request):
    context = page_context(request, title="GDPR", **SECTION, export_form=TenantChoiceForm(), **_jobs_context(request))
    return render(request, "console/gdpr/index.html", context)


@console_view()
def index(request):
    return _page(request)


@console_view()
def live(request):
    """The jobs table alone for an htmx poll; the whole page for anything else."""
    if not request.htmx:
        return _page(request)
    return render(request, "console/gdpr/_jobs.html", page_context(request, **_jobs_context(request)))


# ---- request an erasure: choose the tenant, type its name, POST ------------------------------------------------------


def _request_confirmation(request, tenant: Tenant, *, error: str = "", status: int = 200):
    job = _existing_job(tenant.pk)
    details = [f"Tenant id: {tenant.pk}", f"Status: {tenant.status}"]
    if job is not None:
        details.append(f"It already has an erasure job ({job.state}); requesting again returns that job.")
    context = page_context(
        request,
        **SECTION,
        title="Request an erasure",
        danger=True,
        button="Request erasure",
        question=f"Erase every piece of personal data of {tenant.name}? It starts after a grace window of "
        f"{_duration(settings.KCAAS_ERASURE_GRACE_SECONDS)}, until when it can be cancelled. Then its API keys and "
        "data tokens are revoked, its caches detached and purged on every node, its key material destroyed (what was "
        "sealed under it can never be read again), its name and its keys' and caches' names replaced by pseudonyms, "
        "and its audit events pseudonymised. Once it runs this cannot be undone.",
        details=details,
        action_url=reverse("console:erasure_request", args=[tenant.pk]),
        cancel_url=reverse("console:gdpr"),
        confirm_text=tenant.name,
        confirm_error=error,
    )
    return render(request, "console/confirm.html", context, status=status)


def _existing_job(tenant_id) -> ErasureJob | None:
    try:
        return selectors.erasure_job_for_tenant(tenant_id=tenant_id)
    except NotFoundError:
        return None


@console_view("gdpr.edit")
def erasure_new(request):
    """GET without a tenant: the form; with one: its confirmation step (or the form again with its error, 400)."""
    if "tenant" not in request.GET:
        return render(
            request,
            "console/gdpr/erasure_new.html",
            page_context(request, title="Request an erasure", **SECTION, form=TenantChoiceForm()),
        )
    form = TenantChoiceForm(request.GET)
    if not form.is_valid():
        context = page_context(request, title="Request an erasure", **SECTION, form=form)
        return render(request, "console/gdpr/erasure_new.html", context, status=400)
    return _request_confirmation(request, form.cleaned_data["tenant"])


@console_view("gdpr.edit", methods=("POST",))
def erasure_request(request, tenant_id):
    """privacy.services.erasure_request, as the REST view calls it, once the tenant's name was typed exactly."""
    tenant = tenant_get(tenant_id=tenant_id)
    if request.POST.get("confirm", "").strip() != tenant.name.strip():
        return _request_confirmation(
            request, tenant, error="The name you typed is not the tenant's name. Nothing was requested.", status=400
        )
    before = _existing_job(tenant.pk)
    job, created = services.erasure_request(tenant_id=tenant.pk, requested_by=services.erasure_requester(request.user))
    if created:
        messages.success(
            request,
            f"Erasure of {tenant.name} requested: scheduled to start at "
            f"{_when(job.scheduled_for)} (cancellable until then).",
        )
    elif before is not None and before.state == ErasureState.ERROR:
        messages.success(
            request,
            f"The failed erasure of {tenant.name} is retried: error -> scheduled, "
            f"starting at {_when(job.scheduled_for)}.",
        )
    else:
        messages.info(
            request,
            f"{tenant.name} already has this erasure job ({job.state}, scheduled start "
            f"{_when(job.scheduled_for)}); the same job is kept and nothing changed.",
        )
    return redirect("console:gdpr")


# ---- cancel inside the grace window ----------------------------------------------------------------------------------


@console_view("gdpr.edit", methods=("GET", "POST"))
def erasure_cancel(request, tenant_id):
    """GET: the confirmation; POST: privacy.services.erasure_cancel (as REST; its 409 once the job runs)."""
    job = selectors.erasure_job_for_tenant(tenant_id=tenant_id)
    label = _label(job.tenant_id)
    if request.method == "POST":
        cancelled = services.erasure_cancel(tenant_id=job.tenant_id)
        if job.state == ErasureState.CANCELLED:
            messages.info(request, f"The erasure of {label} was already cancelled; nothing changed.")
        else:
            messages.success(
                request, f"Erasure of {label} cancelled: {job.state} -> {cancelled.state}. The tenant was not touched."
            )
        return redirect("console:gdpr")
    context = page_context(
        request,
        **SECTION,
        title="Cancel an erasure",
        button="Cancel the erasure",
        danger=False,
        question=f"Cancel the erasure of {label}? Its data stays as it is; a new request starts a new grace window.",
        details=[
            f"State: {job.state}",
            f"Scheduled start: {_when(job.scheduled_for)}",
            f"Requested by {job.requested_by} at {_when(job.requested_at)}",
        ],
        action_url=reverse("console:erasure_cancel", args=[job.tenant_id]),
        cancel_url=reverse("console:gdpr"),
    )
    return render(request, "console/confirm.html", context)


# ---- downloads: the signed receipt, the portability archive ----------------------------------------------------------


def _json_attachment(body: str, filename: str) -> HttpResponse:
    response = HttpResponse(body, content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@console_view("gdpr.edit")
def erasure_receipt(request, tenant_id):
    """The signed receipt exactly as GET .../erasure/receipt answers it (409 `erasure_not_complete` before)."""
    job = selectors.erasure_receipt_job(tenant_id=tenant_id)
    body = json.dumps(receipt.receipt_envelope(job), indent=2, sort_keys=True)
    return _json_attachment(body, f"kcaas-erasure-receipt-{job.pk}.json")


@console_view("gdpr.edit", methods=("GET", "POST"))
def tenant_export(request):
    """GET: the form; POST: privacy.export.tenant_export (DATA_EXPORTED) as a JSON attachment. The archive is
    serialized inside the export's transaction, so an archive that cannot be written leaves no event behind."""
    form = TenantChoiceForm(request.POST if request.method == "POST" else None)
    if request.method != "POST" or not form.is_valid():
        context = page_context(request, title="Export a tenant's data", **SECTION, form=form)
        return render(request, "console/gdpr/export.html", context, status=400 if form.is_bound else 200)
    tenant = form.cleaned_data["tenant"]
    with transaction.atomic():
        body = json.dumps(export.tenant_export(tenant=tenant), cls=DjangoJSONEncoder, indent=2)
    name = slugify(tenant.name) or str(tenant.pk)
    return _json_attachment(body, f"kcaas-export-{name}-{timezone.now():%Y-%m-%d}.json")


urlpatterns = [
    path("", index, name="gdpr"),
    path("live", live, name="gdpr_live"),
    path("erasures/new", erasure_new, name="erasure_new"),
    path("tenants/<uuid:tenant_id>/erasure", erasure_request, name="erasure_request"),
    path("tenants/<uuid:tenant_id>/erasure/cancel", erasure_cancel, name="erasure_cancel"),
    path("tenants/<uuid:tenant_id>/erasure/receipt", erasure_receipt, name="erasure_receipt"),
    path("export", tenant_export, name="tenant_export"),
]
