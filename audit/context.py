"""Who is acting and on which request, for the audit trail, without the audit room importing the rooms above it.

- `RequestContextMiddleware` (audit/middleware.py) opens a request scope: a request id (the caller's valid
  `X-Request-ID`, else a new one; echoed in the response), the source IP, and a resolver that turns `request.user`
  into an `Actor` after authentication. Principals describe themselves through an `audit_actor` property (tenant
  keys, node credentials); Django users become `user:<pk>`.
- Celery tasks and management commands act as `acting_as(Actor(...))`; anything else is `system`.

Context variables: each thread (and each asyncio task) has its own scope.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ACTOR_KINDS = ("user", "key", "node", "system")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{8,64}$")


@dataclass(frozen=True, slots=True)
class Actor:
    kind: str  # one of ACTOR_KINDS
    id: str = ""  # user pk, key public id, node id; "" for system

    def __post_init__(self):
        assert self.kind in ACTOR_KINDS, f"unknown actor kind {self.kind!r}"


SYSTEM = Actor("system", "")


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    source_ip: str | None
    resolve_actor: Callable[[], Actor | None]


_request: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("kcaas_audit_request", default=None)
_actor: contextvars.ContextVar[Actor | None] = contextvars.ContextVar("kcaas_audit_actor", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def actor_of(user) -> Actor | None:
    """The actor behind `request.user`: a principal's own `audit_actor`, or a signed-in Django user."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    described = getattr(user, "audit_actor", None)
    if isinstance(described, Actor):
        return described
    return Actor("user", str(user.pk))


@contextlib.contextmanager
def request_scope(info: RequestInfo) -> Iterator[RequestInfo]:
    token = _request.set(info)
    try:
        yield info
    finally:
        _request.reset(token)


@contextlib.contextmanager
def acting_as(actor: Actor) -> Iterator[Actor]:
    """Attribute everything recorded inside to `actor` (a node answering, a beat task, a management command)."""
    token = _actor.set(actor)
    try:
        yield actor
    finally:
        _actor.reset(token)


def current_actor() -> Actor:
    explicit = _actor.get()
    if explicit is not None:
        return explicit
    info = _request.get()
    if info is not None:
        resolved = info.resolve_actor()
        if resolved is not None:
            return resolved
    return SYSTEM


def current_request() -> RequestInfo | None:
    return _request.get()
