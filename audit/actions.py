"""Audit action codes: integers grouped by entity (the thousands), never reused or renumbered. The name is what
exports and the API show next to the code."""

from __future__ import annotations

import enum


class AuditAction(enum.IntEnum):
    # tenants 1xxx
    TENANT_CREATED = 1001
    TENANT_UPDATED = 1002  # name, status (suspend / reactivate)
    QUOTA_UPDATED = 1003
    # API keys 11xx
    KEY_ISSUED = 1101
    KEY_REVOKED = 1102
    KEY_ROTATED = 1103
    # nodes 2xxx
    NODE_CREATED = 2001
    NODE_REGISTERED = 2002
    NODE_CORDONED = 2003
    NODE_UNCORDONED = 2004
    NODE_DRAINING = 2005
    NODE_LOST = 2006
    NODE_CERTIFICATE_ISSUED = 2007  # the platform CA signed a node certificate (register or renewal)
    # caches 3xxx
    CACHE_ATTACHED = 3001
    CACHE_READY = 3002
    CACHE_FAILED = 3003
    CACHE_DETACH_REQUESTED = 3004
    CACHE_DETACHED = 3005
    CACHE_MIGRATED = 3006
    CACHE_REPROVISIONED = 3007  # its node re-registered without it: provisioned again
    CACHE_EMPTIED = 3008  # its node came back without its blocks (restart, lost pool): what it held is gone
    CACHE_RECOVERED = 3009  # its node was lost: re-placed on another node, finding its blocks in the network tier
    # data tokens 31xx
    DATA_TOKEN_ISSUED = 3101
    DATA_TOKENS_REVOKED = 3102
    # engine instances (KV-aware routing) 32xx
    ENGINE_REGISTERED = 3201
    ENGINE_DEREGISTERED = 3202
    ENGINE_LOST = 3203  # its health checks failed: its index dropped
    # billing 4xxx
    USAGE_REPORT_REFUSED = 4001
    RATE_CREATED = 4002
    INVOICE_FINALISED = 4003
    # privacy 5xxx
    ERASURE_REQUESTED = 5001
    ERASURE_CANCELLED = 5002
    ERASURE_STARTED = 5003
    ERASURE_COMPLETED = 5004
    ERASURE_FAILED = 5005
    DATA_EXPORTED = 5006
    # audit 6xxx
    AUDIT_EXPORTED = 6001
    AUDIT_DIGEST_SIGNED = 6002
    AUDIT_PSEUDONYMISED = 6003
    # console 7xxx
    CONSOLE_LOGIN = 7001
    CONSOLE_LOGIN_FAILED = 7002
    CONSOLE_LOGOUT = 7003

    @property
    def code_name(self) -> str:
        return self.name.lower().replace("_", ".", 1)
