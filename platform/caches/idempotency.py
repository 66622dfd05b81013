"""Idempotency-Key for creating requests, with Stripe's semantics, scoped per tenant.

- First request with a key: the key is claimed (a committed `in_progress` record) and the request runs.
- The response is stored in the SAME transaction as the change it reports (by the holder of the claim's
  `lock_token` only), so a record is `complete` exactly when the change committed.
- Same key, same request (method, path and canonical JSON body): the stored response is replayed, same status and
  body, with `Idempotent-Replayed: true`, whatever happened since.
- Same key, different request: 422 `idempotency_key_reused`.
- Same key while the first request is still in flight: 409 `idempotency_in_progress`.
- A refused request (validation, quota, capacity...) stores nothing and frees its key: retrying it with the same
  key runs it again, which is what a client retrying after freeing quota wants.
- A claim whose holder died before committing (nothing committed, the record is still `in_progress`) is taken over
  after IDEMPOTENCY_LOCK_SECONDS; the fencing token makes sure at most one holder ever stores a response.
- Keys expire settings.KCAAS_IDEMPOTENCY_TTL_SECONDS after first use; an expired key is a new key.
"""

import functools
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from rest_framework.response import Response

from caches.errors import IdempotencyInProgress, IdempotencyKeyReused, InvalidIdempotencyKey
from caches.models import IdempotencyRecord, IdempotencyState

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
IDEMPOTENCY_LOCK_SECONDS = 60
KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"  # visible ASCII, no spaces: UUIDs and the like
_KEY_RE = re.compile(KEY_PATTERN)
_CLAIM_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class Claim:
    """This request holds the key: it must complete or release it."""

    record_id: int
    lock_token: uuid.UUID


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    body: object


def request_fingerprint(*, method: str, path: str, body: object) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(f"{method.upper()}\n{path}\n{canonical}".encode()).hexdigest()


def idempotency_claim(*, tenant_id: uuid.UUID, key: str, fingerprint: str) -> Claim | StoredResponse:
    """Claim `key` for a request with `fingerprint`, or return the response to replay, or refuse (422/409)."""
    ttl = timedelta(seconds=settings.KCAAS_IDEMPOTENCY_TTL_SECONDS)
    for _ in range(_CLAIM_ATTEMPTS):
        now = timezone.now()
        token = uuid.uuid4()
        with transaction.atomic():
            record, created = IdempotencyRecord.objects.get_or_create(
                tenant_id=tenant_id,
                key=key,
                defaults={"fingerprint": fingerprint, "lock_token": token, "locked_at": now, "expires_at": now + ttl},
            )
        if created:
            return Claim(record_id=record.pk, lock_token=token)
        if record.expires_at > now:
            if record.fingerprint != fingerprint:
                raise IdempotencyKeyReused(
                    "This Idempotency-Key was used with a different request.", details={"idempotency_key": key}
                )
            if record.state == IdempotencyState.COMPLETE:
                return StoredResponse(status=record.response_status, body=record.response_body)
            if record.locked_at + timedelta(seconds=IDEMPOTENCY_LOCK_SECONDS) > now:
                raise IdempotencyInProgress(
                    "A request with this Idempotency-Key is in progress; retry later.",
                    details={"idempotency_key": key},
                )
        # Expired, or abandoned by a holder that never committed: take it over, unless someone else just did.
        taken = IdempotencyRecord.objects.filter(pk=record.pk, lock_token=record.lock_token, state=record.state).update(
            fingerprint=fingerprint,
            state=IdempotencyState.IN_PROGRESS,
            lock_token=token,
            locked_at=now,
            expires_at=now + ttl,
            response_status=None,
            response_body=None,
        )
        if taken:
            return Claim(record_id=record.pk, lock_token=token)
    raise IdempotencyInProgress("A request with this Idempotency-Key is in progress; retry later.")


def idempotency_complete(*, claim: Claim, status: int, body: object) -> None:
    """Store the response; call inside the transaction of the change. Raises (rolling it back) if the claim was
    taken over meanwhile."""
    stored = IdempotencyRecord.objects.filter(
        pk=claim.record_id, lock_token=claim.lock_token, state=IdempotencyState.IN_PROGRESS
    ).update(state=IdempotencyState.COMPLETE, response_status=status, response_body=body)
    if stored != 1:
        raise IdempotencyInProgress("This request's Idempotency-Key claim was taken over; retry to see its result.")


def idempotency_release(*, claim: Claim) -> None:
    """Forget an unfinished claim (the request was refused or failed): the key may be used again."""
    IdempotencyRecord.objects.filter(
        pk=claim.record_id, lock_token=claim.lock_token, state=IdempotencyState.IN_PROGRESS
    ).delete()


def idempotency_records_purge(*, now=None) -> int:
    """Delete expired records; returns how many."""
    deleted, _ = IdempotencyRecord.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted


def idempotent(view_method):
    """Decorate a creating DRF handler (`post`) with Idempotency-Key semantics.

    The view supplies `idempotency_tenant_id(request)`. Without the header the handler runs as is. With it, the
    handler runs inside one transaction that also stores its 2xx response; `transaction.on_commit` work the
    handler schedules runs only once both are committed.
    """

    @functools.wraps(view_method)
    def wrapper(self, request, *args, **kwargs):
        key = request.headers.get(HEADER)
        if key is None:
            return view_method(self, request, *args, **kwargs)
        if not _KEY_RE.match(key):
            raise InvalidIdempotencyKey(
                "Idempotency-Key must be 1 to 255 visible ASCII characters.", details={"header": HEADER}
            )
        fingerprint = request_fingerprint(method=request.method, path=request.get_full_path(), body=request.data)
        outcome = idempotency_claim(tenant_id=self.idempotency_tenant_id(request), key=key, fingerprint=fingerprint)
        if isinstance(outcome, StoredResponse):
            return Response(outcome.body, status=outcome.status, headers={REPLAYED_HEADER: "true"})
        stored = False
        try:
            with transaction.atomic():
                response = view_method(self, request, *args, **kwargs)
                succeeded = 200 <= response.status_code < 300
                if succeeded:
                    idempotency_complete(claim=outcome, status=response.status_code, body=response.data)
            stored = succeeded  # only once the transaction holding the response has committed
        finally:
            if not stored:
                idempotency_release(claim=outcome)
        return response

    return wrapper
