"""Console pages: onboarding a tenant — create it with its initial quota, issue its API keys — and the warning a
tenant's pages show while an erasure of it is scheduled.

Invariants:
- no logic of its own: a tenant is created by tenants.services.tenant_create (what POST /api/v1/admin/tenants
  calls, here with the quota typed, set in the same transaction), a key issued by tenants.services.api_key_issue
  (what POST /api/v1/keys calls); the services validate again and write the audit events (actor: the console user);
- input the form or the service refuses (a taken or confusable name, a bad limit, no scope) answers 400 with the form
  and the reason next to its field, and creates nothing;
- an issued key's secret is in exactly one answer: the page rendered for the POST that issued it (no-store, never
  a redirect, never in the session, the messages, a URL or a log). Each key form carries a one-time nonce kept in
  the session: a resubmitted POST (a reload of the answer page) issues nothing and shows no secret (409);
- the erasure warning names what console.pages.gdpr shows and privacy.selectors reads: a job not started yet
  (pending or scheduled), when it runs, and where a compliance officer cancels it.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone

from console.access import console_view, error_page, page_context
from console.forms import ApiKeyIssueForm, TenantCreateForm
from core.errors import ConflictError, NotFoundError, QuotaExceeded
from privacy import selectors as privacy_selectors
from privacy.models import CANCELLABLE_STATES, ErasureJob, ErasureState
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.models import Tenant

KEY_NONCES = "kcaas_console_key_forms"  # session: the nonces of key forms shown and not yet used
MAX_KEY_NONCES = 20  # open key forms remembered per session (the oldest is forgotten first)
DEFAULT_SCOPES = ["caches:write", "usage:read"]  # what an engine's key needs: attach and use caches, read usage


def _render(request, template: str, status: int = 200, **context):
    return render(request, template, page_context(request, section="tenants", **context), status=status)


# ---- the erasure warning ---------------------------------------------------------------------------------------------


def erasure_warning(tenant: Tenant) -> dict | None:
    """What a tenant's pages say about its erasure: None when none is scheduled or running; else the job, whether it
    can still be cancelled, and when it runs (scheduled_for, UTC)."""
    try:
        job = privacy_selectors.erasure_job_for_tenant(tenant_id=tenant.pk)
    except NotFoundError:
        return None
    if job.state not in (*CANCELLABLE_STATES, ErasureState.RUNNING):
        return None
    return {"job": job, "cancellable": job.state in CANCELLABLE_STATES, "runs_at": job.scheduled_for}


def erasures_by_tenant(tenant_ids: list) -> dict[object, ErasureJob]:
    """{tenant id: its erasure not started yet} for the tenants list's marker (one query)."""
    return privacy_selectors.erasures_not_started(tenant_ids=tenant_ids)


# ---- new tenant ------------------------------------------------------------------------------------------------------


def _name_error(error: Exception) -> str:
    """The service's reason a name was refused, as one sentence for the form."""
    details = getattr(error, "details", None) or {}
    field_errors = (details.get("fields") or {}).get("name")
    if isinstance(error, ConflictError) and error.code == "tenant_name_taken":
        return "A tenant with this name exists: choose another name."
    if isinstance(error, ConflictError) and error.code == "tenant_name_confusable":
        other = (details.get("confusable_with") or {}).get("name", "")
        return f"This name looks like the existing tenant name “{other}”: choose another name."
    return " ".join(field_errors) if field_errors else error.message


@console_view("tenants.edit", methods=("GET", "POST"))
def tenant_new(request):
    """Operator: a new tenant (name + initial quota) through tenants.services.tenant_create, then its page. Refused
    input: 400 with the form, nothing created, no event."""
    data = request.POST if request.method == "POST" else None
    form = TenantCreateForm(data, defaults=settings.KCAAS_QUOTA_DEFAULTS)
    if request.method == "POST" and form.is_valid():
        try:
            tenant = tenant_services.tenant_create(name=form.cleaned_data["name"], quota=form.quota())
        except (tenant_services.ValidationFailed, ConflictError) as error:
            fields = ((getattr(error, "details", None) or {}).get("fields")) or {"name": []}
            for field, reasons in fields.items():
                target = field if field in form.fields else None
                form.add_error(target, _name_error(error) if field == "name" else " ".join(reasons))
        else:
            messages.success(
                request,
                f"Tenant {tenant.name} created. Next: issue its first API key (Issue API key, under API keys).",
            )
            return redirect("console:tenant", tenant_id=tenant.pk)
    return _render(
        request,
        "console/tenants/new.html",
        status=400 if request.method == "POST" else 200,
        title="New tenant",
        form=form,
        quota_fields=[form[field] for field in tenant_services.QUOTA_BOUNDS],
        defaults=settings.KCAAS_QUOTA_DEFAULTS,
    )


# ---- issue an API key ------------------------------------------------------------------------------------------------


def _new_nonce(request) -> str:
    nonce = secrets.token_urlsafe(24)
    request.session[KEY_NONCES] = [*request.session.get(KEY_NONCES, [])[-(MAX_KEY_NONCES - 1) :], nonce]
    return nonce


def _use_nonce(request, nonce: str) -> bool:
    """Whether `nonce` is one this session was given and has not used (it is used up now)."""
    open_nonces = request.session.get(KEY_NONCES, [])
    if not nonce or nonce not in open_nonces:
        return False
    request.session[KEY_NONCES] = [n for n in open_nonces if n != nonce]
    return True


def _key_form_page(request, tenant: Tenant, form: ApiKeyIssueForm, *, status: int = 200):
    return _render(
        request,
        "console/tenants/key_new.html",
        status=status,
        title=f"Issue an API key for {tenant.name}",
        tenant=tenant,
        form=form,
        nonce=_new_nonce(request),
        chosen=form["scopes"].value() or [],
        erasure=erasure_warning(tenant),
    )


@console_view("tenants.edit", methods=("GET", "POST"))
def key_issue(request, tenant_id):
    """Operator: GET shows the form; POST issues the key through tenants.services.api_key_issue and answers the one
    page that shows its secret (no-store). Refused input: 400 with the form; a form already used: 409, nothing
    issued; a tenant at its key quota: 403 with the service's message; an erasing tenant: 409."""
    tenant = tenant_selectors.tenant_get(tenant_id=tenant_id)
    if request.method == "GET":
        return _key_form_page(request, tenant, ApiKeyIssueForm(initial={"scopes": DEFAULT_SCOPES}))
    form = ApiKeyIssueForm(request.POST)
    if not _use_nonce(request, request.POST.get("nonce", "")):
        detail_url = reverse("console:tenant", kwargs={"tenant_id": tenant.pk})
        return error_page(
            request,
            409,
            "Form already used",
            "This form was already sent, so no key was issued now. A key's secret is shown once, on the page that "
            f"issued it, and never again: if it was lost, revoke that key on {detail_url} and issue a new one.",
            "form_already_used",
        )
    if not form.is_valid():
        return _key_form_page(request, tenant, form, status=400)
    days = form.cleaned_data["expires_in_days"]
    try:
        issued = tenant_services.api_key_issue(
            tenant=tenant,
            scopes=form.cleaned_data["scopes"],
            name=form.cleaned_data["name"],
            expires_at=timezone.now() + timedelta(days=days) if days else None,
        )
    except tenant_services.ValidationFailed as error:
        for field, reasons in ((error.details or {}).get("fields") or {}).items():
            form.add_error(field if field in form.fields else None, " ".join(reasons))
        return _key_form_page(request, tenant, form, status=400)
    except QuotaExceeded as error:
        form.add_error(None, error.message)
        return _key_form_page(request, tenant, form, status=403)
    response = _render(
        request,
        "console/tenants/key_issued.html",
        title=f"API key issued for {tenant.name}",
        tenant=tenant,
        api_key=issued.api_key,
        raw_key=issued.raw_key,
        control_plane_url=request.build_absolute_uri("/").rstrip("/"),
    )
    response["Cache-Control"] = "no-store"
    return response
