"""Control-plane settings, all from environment variables, with an embedded default that needs no external service.

Embedded default (`make up`): SQLite under var/, a file-system Celery transport under var/celery, an in-process rate
limiter. Production and the tests: DATABASE_URL (PostgreSQL), REDIS_URL (rate limits, key usage counters) and
CELERY_BROKER_URL (defaults to REDIS_URL).
"""

import os
import secrets
from pathlib import Path

import dj_database_url

REPO_ROOT = Path(__file__).resolve().parents[2]
VAR_DIR = Path(os.environ.get("KCAAS_VAR_DIR", REPO_ROOT / "var"))


def env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _dev_secret(name: str) -> str:
    """A random secret kept under var/ for the embedded default; production sets the variable. make up's processes
    (gunicorn's workers, the Celery worker and beat) import these settings at once on a first start: the file is
    created complete and linked into place once (audit.keys.load_or_create_private_file), so every process reads the
    one secret that won, never an empty or half-written file, nor a second secret of its own."""
    from audit.keys import load_or_create_private_file

    return (
        load_or_create_private_file(VAR_DIR / "secrets" / name, lambda: secrets.token_urlsafe(48).encode())
        .decode()
        .strip()
    )


SECRET_KEY = os.environ.get("SECRET_KEY") or _dev_secret("django-secret-key")
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "django_otp",
    "django_otp.plugins.otp_totp",
    "audit",
    "tenants",
    "fleet",
    "caches",
    "routing",
    "billing",
    "privacy",
    "console",
]

MIDDLEWARE = [
    "controlplane.metrics.RequestMetricsMiddleware",  # /metrics: every answer counted and timed by route name
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.RequestLimits",  # body size and JSON depth (413/411/400), no-store on API answers
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django_otp.middleware.OTPMiddleware",  # request.user.is_verified(): the console's second factor
    "audit.middleware.RequestContextMiddleware",  # request id, source IP and actor for the audit trail
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "console.middleware.ConsoleSessionMiddleware",  # console idle/absolute expiry, CSP
    "core.query_parameters.RejectUndocumentedQueryParameters",  # /api/v1/: the schema's query parameters only
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_ROOT / "platform" / "core" / "templates"],  # the API docs page (core/templates/api_docs)
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'kcaas.sqlite3'}"),
        conn_max_age=60,
        conn_health_checks=True,  # a connection the server dropped is replaced before use, not failed on
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default's concurrency (docs/operations.md): WAL (readers never wait for the writer), every
    # transaction takes the write lock at BEGIN (no deadlocked upgrade from a read lock, which SQLite fails at
    # once instead of waiting), and a writer waits up to 20 s for the lock before "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
# Static files (Redoc, htmx, the console's stylesheet) are served from the apps' folders: no collectstatic step, so no
# STATIC_ROOT (whitenoise warns at every start when that folder does not exist).
WHITENOISE_USE_FINDERS = True

# Request bodies (controlplane.middleware): the largest body any operation takes is a node's usage report or heartbeat
# at its 10,000 entries (~2.5 MB); no operation's JSON nests deeper than 3.
KCAAS_MAX_REQUEST_BYTES = env_int("KCAAS_MAX_REQUEST_BYTES", 4 * 2**20)
KCAAS_MAX_JSON_DEPTH = env_int("KCAAS_MAX_JSON_DEPTH", 32)
DATA_UPLOAD_MAX_MEMORY_SIZE = KCAAS_MAX_REQUEST_BYTES  # Django's own check, for bodies read without the middleware

# GET /metrics (docs/observability.md): with a token, scrapes send `Authorization: Bearer <token>`; without one, only
# loopback clients may scrape (make up).
KCAAS_METRICS_TOKEN = os.environ.get("KCAAS_METRICS_TOKEN", "")

REDIS_URL = os.environ.get("REDIS_URL", "")  # empty: the embedded default (in-process rate limiter)

# ---- Celery ---------------------------------------------------------------------------------------------------------
from kcaas.node_protocol import broker as fs_broker  # noqa: E402 - registers kcaasfs://, the embedded default's hardened file broker

# Celery itself prefers the CELERY_BROKER_URL variable to this setting, so the default only applies when it is unset
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL or fs_broker.URL
CELERY_BROKER_TRANSPORT_OPTIONS = (
    fs_broker.folder_options(VAR_DIR / "celery")  # the same folders as the node agents' (scripts/up.py)
    if fs_broker.is_file_broker(CELERY_BROKER_URL)
    else {"visibility_timeout": 3600}
)
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ACKS_LATE = True  # a task is acknowledged after it ran: a worker lost mid-task leaves it queued
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A lost node is seen within its lease (KCAAS_NODE_LEASE_SECONDS) plus one sweep period.
KCAAS_LEASE_SWEEP_SECONDS = float(os.environ.get("KCAAS_LEASE_SWEEP_SECONDS", "10"))
# A migration with no node answer (progress or result) for this long is failed and its target released.
KCAAS_MIGRATION_STALL_SECONDS = float(os.environ.get("KCAAS_MIGRATION_STALL_SECONDS", "600"))
# How often beat moves erasure jobs (starts those past their grace, finishes confirmed ones).
KCAAS_ERASURE_TICK_SECONDS = float(os.environ.get("KCAAS_ERASURE_TICK_SECONDS", "10"))
# The node-order outbox (fleet.outbox): how often beat publishes due orders; an order that expects an answer is sent
# again after RESEND seconds, doubling up to RESEND_MAX, until the node answers; orders older than MAX_AGE are dropped.
KCAAS_ORDER_DISPATCH_SECONDS = float(os.environ.get("KCAAS_ORDER_DISPATCH_SECONDS", "2"))
KCAAS_ORDER_RESEND_SECONDS = float(os.environ.get("KCAAS_ORDER_RESEND_SECONDS", "10"))
KCAAS_ORDER_RESEND_MAX_SECONDS = float(os.environ.get("KCAAS_ORDER_RESEND_MAX_SECONDS", "60"))
KCAAS_ORDER_MAX_AGE_SECONDS = float(os.environ.get("KCAAS_ORDER_MAX_AGE_SECONDS", "3600"))
# A cache provisioning (or detaching) for longer than this is ended by the reconciler: failed with
# `provisioning_timeout` (its reservation released, the node told to drop it), or detached (`detach_unconfirmed`).
KCAAS_PROVISION_DEADLINE_SECONDS = float(os.environ.get("KCAAS_PROVISION_DEADLINE_SECONDS", "300"))
# The fleet's network store (docs/ARCHITECTURE.md, the network tier): the bytes caches may ask for in all
# (capacity.network, summed over caches not detached). 0: no network tier configured (an attach asking for one is
# refused: network_tier_absent).
KCAAS_NETWORK_STORE_BYTES = env_int("KCAAS_NETWORK_STORE_BYTES", 0)
KCAAS_DETACH_DEADLINE_SECONDS = float(os.environ.get("KCAAS_DETACH_DEADLINE_SECONDS", "300"))
KCAAS_RECONCILE_SECONDS = float(os.environ.get("KCAAS_RECONCILE_SECONDS", "30"))
CELERY_BEAT_SCHEDULE = {
    "fleet-dispatch-orders": {
        "task": "fleet.dispatch_orders",
        "schedule": KCAAS_ORDER_DISPATCH_SECONDS,
        "options": {"expires": 5 * KCAAS_ORDER_DISPATCH_SECONDS},
    },
    "caches-reconcile": {"task": "caches.reconcile", "schedule": KCAAS_RECONCILE_SECONDS},
    # Data tokens of suspended/erased tenants and of revoked/expired keys are revoked and pushed to their nodes.
    "caches-cascade-token-revocations": {
        "task": "caches.cascade_token_revocations",
        "schedule": float(os.environ.get("KCAAS_TOKEN_CASCADE_SECONDS", "5")),
        "options": {"expires": 30.0},
    },
    "caches-sweep-leases": {"task": "caches.sweep_leases", "schedule": KCAAS_LEASE_SWEEP_SECONDS},
    "caches-purge-expired": {"task": "caches.purge_expired", "schedule": 3600.0},
    "caches-expire-migrations": {"task": "caches.expire_migrations", "schedule": 60.0},
    "tenants-flush-key-usage": {"task": "tenants.flush_key_usage", "schedule": 30.0},
    # Billing: recompute the open ledger hours and prune old samples; refresh and finalise invoices.
    "billing-rollup": {"task": "billing.rollup", "schedule": float(os.environ.get("KCAAS_USAGE_ROLLUP_SECONDS", 300))},
    "billing-invoices": {"task": "billing.invoices", "schedule": 3600.0},
    "privacy-run-erasures": {"task": "privacy.run_erasures", "schedule": KCAAS_ERASURE_TICK_SECONDS},
    # Signs each closed audit period within minutes of its end (idempotent: a period is signed once).
    "audit-sign-digests": {"task": "audit.sign_digests", "schedule": 300.0},
    "fleet-prune-samples": {"task": "fleet.prune_samples", "schedule": 3600.0},  # the console's chart history
}

# ---- REST -----------------------------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ApiKeyAuthentication",
        # Staff sessions and passwords, except console users' (their second factor and role would be bypassed).
        "controlplane.authentication.NonConsoleSessionAuthentication",
        "controlplane.authentication.NonConsoleBasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_THROTTLE_CLASSES": ["tenants.ratelimit.TenantRateThrottle"],
    "EXCEPTION_HANDLER": "core.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "controlplane.openapi.AutoSchema",  # lists only the schemes each operation accepts
    "DEFAULT_PAGINATION_CLASS": "core.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "KCaaS control plane API",
    "DESCRIPTION": "Tenants, API keys, quotas, caches, data-plane tokens and the node fleet.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # The schemes the REST API accepts: no session cookie (the console's sessions are refused there; there is no
    # other sign-in page). controlplane.openapi narrows each operation further and adds its curl sample.
    "AUTHENTICATION_WHITELIST": [
        "tenants.authentication.ApiKeyAuthentication",
        "controlplane.authentication.NonConsoleBasicAuthentication",
        "fleet.authentication.NodeCredentialAuthentication",
    ],
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "controlplane.openapi.add_code_samples"],
    "REDOC_DIST": "SIDECAR",  # the docs pages work without internet access: every asset is served from here
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},  # no badge fetched from validator.swagger.io
    "REDOC_UI_SETTINGS": {"expandResponses": "200,201"},
    # Tags by resource, in the order Redoc and Swagger UI show them: the main resources first, the JWKS last.
    "TAGS": [
        {"name": "caches", "description": "Attach, list, inspect and detach KV caches."},
        {"name": "routing", "description": "Engine instances, their KV events, and where a prompt's prefix is."},
        {"name": "tokens", "description": "Short-lived data-plane tokens for one cache, and their revocation."},
        {"name": "keys", "description": "The tenant's API keys: issue, rotate, revoke; who am I."},
        {"name": "usage", "description": "Quota limits against current use, and metered usage over time."},
        {"name": "invoices", "description": "The tenant's invoices."},
        {"name": "audit", "description": "The hash-chained audit trail: events, signed digests, exports."},
        {"name": "privacy", "description": "GDPR: portability exports and erasure (Art. 17, 20)."},
        {"name": "admin", "description": "Staff: tenants, quotas, nodes, rates."},
        {"name": "nodes", "description": "Node agents only: register, heartbeat, usage reports, certificates."},
        {"name": "well-known", "description": "Public keys and CA certificates, no authentication."},
    ],
    "ENUM_NAME_OVERRIDES": {
        "CacheStateEnum": "caches.models.CacheState",
        "NodeStateEnum": "fleet.models.NodeState",
        "ApiKeyStateEnum": ["active", "expired", "revoked"],
    },
}

# ---- KCaaS -----------------------------------------------------------------------------------------------------------
# Pepper for API key and node credential hashes (HMAC-SHA256): a server secret, so a leaked table cannot be
# brute-forced offline even for a weak secret (ours are 256-bit anyway).
KCAAS_KEY_PEPPER = os.environ.get("KCAAS_KEY_PEPPER") or _dev_secret("key-pepper")
# Ed25519 private key (PEM) signing data-plane tokens; nodes verify with the public key at /.well-known/jwks.json.
KCAAS_TOKEN_SIGNING_KEY_PEM = os.environ.get("KCAAS_TOKEN_SIGNING_KEY_PEM", "")
KCAAS_TOKEN_SIGNING_KEY_FILE = os.environ.get(
    "KCAAS_TOKEN_SIGNING_KEY_FILE", str(VAR_DIR / "secrets" / "token-ed25519.pem")
)
# The platform key: signs audit digests and erasure receipts (audit.keys); public half at
# /.well-known/kcaas-platform-key.json.
KCAAS_PLATFORM_SIGNING_KEY_PEM = os.environ.get("KCAAS_PLATFORM_SIGNING_KEY_PEM", "")
KCAAS_PLATFORM_SIGNING_KEY_FILE = os.environ.get(
    "KCAAS_PLATFORM_SIGNING_KEY_FILE", str(VAR_DIR / "secrets" / "platform-ed25519.pem")
)
# The platform CA (fleet.pki): ECDSA P-256 key signing node certificates (spiffe://kcaas/node/<id>); its self-signed
# certificate is derived from the key (deterministic), so every control-plane process serves the same one.
KCAAS_PLATFORM_CA_KEY_PEM = os.environ.get("KCAAS_PLATFORM_CA_KEY_PEM", "")
KCAAS_PLATFORM_CA_KEY_FILE = os.environ.get(
    "KCAAS_PLATFORM_CA_KEY_FILE", str(VAR_DIR / "secrets" / "platform-ca-p256.pem")
)
# The CA of data-plane certificates made outside the platform CA (`make up`'s dev CA, an operator's own): published
# after the platform CA at /.well-known/kcaas-ca.pem so the SDK trusts nodes serving either; "" or a missing file: none.
KCAAS_DATA_PLANE_CA_FILE = os.environ.get("KCAAS_DATA_PLANE_CA_FILE", str(VAR_DIR / "secrets" / "dev-ca.pem"))
KCAAS_NODE_CERT_HOURS = env_int("KCAAS_NODE_CERT_HOURS", 12)  # node certificates' validity; agents renew at half
KCAAS_TOKEN_ISSUER = os.environ.get("KCAAS_TOKEN_ISSUER", "kcaas-control-plane")
KCAAS_DATA_TOKEN_TTL_SECONDS = env_int("KCAAS_DATA_TOKEN_TTL_SECONDS", 15 * 60)
# Key-encryption key for per-cache secrets held by the control plane (AES-256-GCM).
KCAAS_KEK = os.environ.get("KCAAS_KEK") or _dev_secret("kek")
# HMAC key for sensitive values in audit events (the trail keeps their HMAC, never the value).
KCAAS_AUDIT_HMAC_KEY = os.environ.get("KCAAS_AUDIT_HMAC_KEY") or _dev_secret("audit-hmac")
# Length of a signed audit digest period (audit.digests), in seconds; periods align to multiples of it.
KCAAS_AUDIT_DIGEST_SECONDS = env_int("KCAAS_AUDIT_DIGEST_SECONDS", 3600)
# KV-aware routing (docs/routing.md): the networks engine instances may be registered in (the indexer connects to
# them), and how long an instance's health checks may fail before it is lost and its index dropped.
KCAAS_ROUTING_ENGINE_NETWORKS = tuple(
    n.strip()
    for n in os.environ.get(
        "KCAAS_ROUTING_ENGINE_NETWORKS", "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16"
    ).split(",")
    if n.strip()
)
KCAAS_ROUTING_STALE_SECONDS = env_int("KCAAS_ROUTING_STALE_SECONDS", 15)
# How often the indexer reads each ready cache's block events from its node (routing.cache_follower).
KCAAS_ROUTING_CACHE_POLL_SECONDS = float(os.environ.get("KCAAS_ROUTING_CACHE_POLL_SECONDS", "1.0"))

# Proxies whose X-Forwarded-For names the client (addresses or networks, comma-separated); none by default.
KCAAS_TRUSTED_PROXIES = [p.strip() for p in os.environ.get("KCAAS_TRUSTED_PROXIES", "").split(",") if p.strip()]

KCAAS_QUOTA_DEFAULTS = {
    "max_caches": env_int("KCAAS_QUOTA_MAX_CACHES", 10),
    "max_device_bytes": env_int("KCAAS_QUOTA_MAX_DEVICE_BYTES", 16 * 2**30),
    "max_dram_bytes": env_int("KCAAS_QUOTA_MAX_DRAM_BYTES", 64 * 2**30),
    "max_ssd_bytes": env_int("KCAAS_QUOTA_MAX_SSD_BYTES", 256 * 2**30),
    "max_network_bytes": env_int("KCAAS_QUOTA_MAX_NETWORK_BYTES", 256 * 2**30),
    "max_requests_per_second": env_int("KCAAS_QUOTA_MAX_RPS", 50),
    "max_data_tokens_outstanding": env_int("KCAAS_QUOTA_MAX_DATA_TOKENS", 100),
    "max_api_keys": env_int("KCAAS_QUOTA_MAX_API_KEYS", 100),  # usable (neither revoked nor expired) keys
}
KCAAS_NODE_HEARTBEAT_SECONDS = env_int("KCAAS_NODE_HEARTBEAT_SECONDS", 10)
KCAAS_NODE_LEASE_SECONDS = env_int("KCAAS_NODE_LEASE_SECONDS", 40)  # Kubernetes' node grace period
# Called when a node (re-)registers with the caches it still holds; re-provisions what it lost and returns what it
# should host. fleet sits below caches and cannot import it: the project wires the upper room in here (as Django
# wires AUTH_USER_MODEL), so the layering holds.
KCAAS_NODE_REGISTER_RECONCILER = "caches.services.caches_reconcile_node"
# Called on every heartbeat that carries a resident snapshot: a cache the control plane believes ready on the node
# but the node no longer reports is provisioned again (caches.reconcile; the same hook pattern as above).
KCAAS_NODE_HEARTBEAT_RECONCILER = "caches.reconcile.caches_reconcile_resident"
# The unexpired revoked data tokens of a node's caches, answered to its register and heartbeat calls (fleet cannot
# import caches: the hook names the selector).
KCAAS_NODE_REVOKED_TOKENS = "caches.selectors.data_tokens_revoked_on_node"
# The caches whose blocks a (re-)registering node may keep on disk (placed on it or migrating to it), answered to its
# register call: it deletes the SSD directories of any other cache (the hook names the selector, as above).
KCAAS_NODE_STORED_CACHES = "caches.selectors.cache_ids_stored_on_node"
# Called (node_id=...) after a node (re-)registers, after the reconciler; e.g. privacy resends the purges of running
# erasures to a node that was lost while they started.
KCAAS_NODE_REGISTER_HOOKS = ["privacy.services.erasure_node_registered", "caches.migration.migrations_redrive_node"]
# GDPR erasure: the grace window between the request and the start (cancellable inside it), and how long a node's
# purge may stay unanswered before beat sends it again.
KCAAS_ERASURE_GRACE_SECONDS = env_int("KCAAS_ERASURE_GRACE_SECONDS", 24 * 3600)
KCAAS_ERASURE_RESEND_SECONDS = env_int("KCAAS_ERASURE_RESEND_SECONDS", 300)
KCAAS_IDEMPOTENCY_TTL_SECONDS = env_int("KCAAS_IDEMPOTENCY_TTL_SECONDS", 24 * 3600)
# Billing (docs/compliance.md): node usage reports sampled longer ago than the grace are ignored; one sample's bytes
# hold at most the max gap; invoices become final this many days after their month (>= the usage grace).
KCAAS_USAGE_GRACE_SECONDS = env_int("KCAAS_USAGE_GRACE_SECONDS", 24 * 3600)
KCAAS_USAGE_MAX_GAP_SECONDS = env_int("KCAAS_USAGE_MAX_GAP_SECONDS", 180)
# Heartbeat samples for the console's charts (fleet.samples): one per node per interval, kept this many days.
KCAAS_SAMPLE_SECONDS = env_int("KCAAS_SAMPLE_SECONDS", 60)
KCAAS_SAMPLE_RETENTION_DAYS = env_int("KCAAS_SAMPLE_RETENTION_DAYS", 30)
KCAAS_USAGE_MAX_CLOCK_SKEW_SECONDS = env_int("KCAAS_USAGE_MAX_CLOCK_SKEW_SECONDS", 300)
KCAAS_INVOICE_GRACE_DAYS = env_int("KCAAS_INVOICE_GRACE_DAYS", 3)
KCAAS_BILLING_CURRENCY = os.environ.get("KCAAS_BILLING_CURRENCY", "USD")
# GCRA burst: a tenant may send this many seconds' worth of its rate at once.
KCAAS_RATE_LIMIT_BURST_SECONDS = float(os.environ.get("KCAAS_RATE_LIMIT_BURST_SECONDS", "1"))


# ---- TLS (docs/operations.md, "Behind TLS") --------------------------------------------------------------------------
# `make up` serves plain HTTP on 127.0.0.1, so every default here is off; a deployment behind a TLS-terminating proxy
# turns them on. KCAAS_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto: https" makes a request carrying that header count
# as HTTPS (HSTS, secure cookies, CSRF's origin check): set it only when the proxy always sets that header itself,
# overwriting what a client sent. HSTS is sent on HTTPS answers only (Django's SecurityMiddleware).
def env_proxy_ssl_header(name: str) -> tuple[str, str] | None:
    """The header a TLS-terminating proxy sets, as Django's META name and value: "X-Forwarded-Proto: https" ->
    ("HTTP_X_FORWARDED_PROTO", "https"); unset or empty -> None (no request counts as HTTPS but TLS to Django)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    header, sep, value = text.partition(":")
    header, value = header.strip().upper().replace("-", "_"), value.strip()
    if not sep or not header or not value:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(f'{name} must read "Header-Name: value", e.g. "X-Forwarded-Proto: https"')
    return (header if header.startswith("HTTP_") else f"HTTP_{header}", value)


SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header("KCAAS_SECURE_PROXY_SSL_HEADER")
SECURE_HSTS_SECONDS = env_int("KCAAS_HSTS_SECONDS", 0)  # e.g. 31536000 (a year) once HTTPS works everywhere
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("KCAAS_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("KCAAS_HSTS_PRELOAD", False)
SECURE_SSL_REDIRECT = env_bool("KCAAS_SSL_REDIRECT", False)  # plain-HTTP requests are redirected to HTTPS
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # health checks probe the app server directly, over HTTP
# Cookies (the console's session and CSRF token) that never travel over plain HTTP: KCAAS_SECURE_COOKIES=1.
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("KCAAS_SECURE_COOKIES", False)
# Origins (scheme://host[:port], comma-separated) the console's forms may be posted from besides the Host itself.
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("KCAAS_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

# ---- the web console (platform/console) ------------------------------------------------------------------------------
LOGIN_URL = "/console/login"
KCAAS_CONSOLE_IDLE_SECONDS = env_int("KCAAS_CONSOLE_IDLE_SECONDS", 30 * 60)  # no user request for this long: signed out
KCAAS_CONSOLE_MAX_SESSION_SECONDS = env_int("KCAAS_CONSOLE_MAX_SESSION_SECONDS", 12 * 3600)  # after sign-in, at most
SESSION_COOKIE_AGE = KCAAS_CONSOLE_MAX_SESSION_SECONDS
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"
CSRF_FAILURE_VIEW = "console.views_errors.csrf_failure"  # an HTML page saying what to do (DRF answers its own JSON)
OTP_TOTP_ISSUER = os.environ.get("KCAAS_TOTP_ISSUER", "KCaaS console")
KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE = env_int("KCAAS_CONSOLE_PASSWORD_TRIES_PER_MINUTE", 10)  # per username
OTP_TOTP_THROTTLE_FACTOR = 1  # seconds; doubles with each wrong code
# Failed console password tries per source address (IPv6: per /64) per window, whatever the usernames: against
# password spraying. GCRA: that many at once, then one per window/count; a successful password gives its try back.
KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE = env_int("KCAAS_CONSOLE_PASSWORD_FAILURES_PER_SOURCE", 30)
KCAAS_CONSOLE_SOURCE_WINDOW_SECONDS = env_int("KCAAS_CONSOLE_SOURCE_WINDOW_SECONDS", 600)
# The REST API's password door (HTTP Basic for staff, controlplane.authentication): failed tries per account
# (username) and per source address per minute, refused (429) before any password hash; successes are not counted.
KCAAS_API_PASSWORD_FAILURES_PER_MINUTE = env_int("KCAAS_API_PASSWORD_FAILURES_PER_MINUTE", 10)
KCAAS_API_PASSWORD_FAILURES_PER_SOURCE_PER_MINUTE = env_int("KCAAS_API_PASSWORD_FAILURES_PER_SOURCE_PER_MINUTE", 30)
# A credential the REST door refused is refused again for this long without a hash and without counting (0: off).
KCAAS_PASSWORD_FAILURE_MEMO_SECONDS = env_int("KCAAS_PASSWORD_FAILURE_MEMO_SECONDS", 600)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "WARNING")},
}
