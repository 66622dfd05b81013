"""Request and response examples for the staff node operations of the published reference (an H100 node: 80 GB of
HBM, of which 64 GiB for caches, 512 GiB of DRAM and 4 TiB of SSD)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

GIB = 2**30
NODE_ID = "c3d4e5f6-a7b8-4c9d-8e0f-1a2b3c4d5e6f"
CACHE_ID = "5f0c2a8e-3b6d-4e7a-9c1f-2d8b7a6e4c10"
CAPACITY = {"device": 64 * GIB, "dram": 512 * GIB, "ssd": 4096 * GIB}
RESERVED = {"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0}

NODE = {
    "id": NODE_ID,
    "name": "node-7",
    "endpoint": "node-7.kcaas.example:7443",
    "state": "ready",
    "capacity": CAPACITY,
    "reserved": RESERVED,
    "free": {tier: CAPACITY[tier] - RESERVED[tier] for tier in CAPACITY},
    "lease_expires_at": "2026-03-02T10:15:40Z",
    "last_heartbeat_at": "2026-03-02T10:15:00Z",
    "registered_at": "2026-03-01T08:05:00Z",
    "created_at": "2026-03-01T08:00:00Z",
}
_ZERO = {"device": 0, "dram": 0, "ssd": 0}

NODE_LIST = OpenApiExample(
    "One page of nodes",
    value={"count": 1, "next": None, "previous": None, "results": [NODE]},
    response_only=True,
    status_codes=["200"],
)
NODE_CREATE = OpenApiExample("A new node", value={"name": "node-7"}, request_only=True)
NODE_CREATED = OpenApiExample(
    "Created: the agent registers with this credential (shown once)",
    value={
        "node": {
            **NODE,
            "endpoint": "",
            "state": "registering",
            "capacity": _ZERO,
            "reserved": _ZERO,
            "free": _ZERO,
            "lease_expires_at": None,
            "last_heartbeat_at": None,
            "registered_at": None,
        },
        "credential": "kc_node_N7dQ2wXk9Lm4Rp8T_EXAMPLEonlyEXAMPLEonlyEXAMPLEonlyEXAMPLEonl2Xsed6",
    },
    response_only=True,
    status_codes=["201"],
)
NODE_DETAIL = OpenApiExample(
    "A ready node holding one cache",
    value={
        **NODE,
        "resident": {
            "reported_at": "2026-03-02T10:15:00+00:00",
            "caches": {CACHE_ID: {"device": 6 * GIB, "dram": 11 * GIB, "ssd": 0, "network": 0}},
        },
    },
    response_only=True,
    status_codes=["200"],
)
NODE_CORDONED = OpenApiExample(
    "Cordoned", value={**NODE, "state": "cordoned"}, response_only=True, status_codes=["200"]
)
NODE_UNCORDONED = OpenApiExample("Ready again", value=NODE, response_only=True, status_codes=["200"])


# ---- node agents: node-7 restarts at 14:30 still holding its cache, heartbeats, renews its certificate at half-life --
# The PEMs are real: an example platform CA (its P-256 key is the sha256 of EXAMPLE_CA_LABEL, its certificate what
# fleet.pki makes of that key), node-7's certificate for the key of its CSR (the sha256 of EXAMPLE_NODE_KEY_LABEL;
# spiffe://kcaas/node/<id> and its endpoint's name), issued at 14:30 (12 hours) and renewed at 20:30.
EXAMPLE_CA_LABEL = "kcaas reference example CA"
EXAMPLE_NODE_KEY_LABEL = "kcaas reference example node-7"

CA_PEM = (
    "-----BEGIN CERTIFICATE-----\n"
    "MIIBgDCCASagAwIBAgITFivl8TTEEq7C2/Z51Xtqj76D4TAKBggqhkjOPQQDAjAc\n"
    "MRowGAYDVQQDDBFLQ2FhUyBwbGF0Zm9ybSBDQTAgFw0yNTAxMDEwMDAwMDBaGA85\n"
    "OTk5MTIzMTIzNTk1OVowHDEaMBgGA1UEAwwRS0NhYVMgcGxhdGZvcm0gQ0EwWTAT\n"
    "BgcqhkjOPQIBBggqhkjOPQMBBwNCAARgwMRpurFRy/EgiJMR8y+hRxS+VQ40+koj\n"
    "CRSBkE+6jAfaYhFst14U5xoSnzsSHCrJdFi5RZnBsKMFoOdwlEnho0UwQzASBgNV\n"
    "HRMBAf8ECDAGAQH/AgEAMA4GA1UdDwEB/wQEAwIBBjAdBgNVHQ4EFgQUvlgNoj7X\n"
    "X148YJ8LEQ+77lmnsiYwCgYIKoZIzj0EAwIDSAAwRQIhAK0uqcwRX1zUS2LdNV2T\n"
    "f0YYQ/cxTd5IFKJkDn139V+VAiAkHwwA1UqSBc11q8F+8M4A5z4sI56blkIylH5i\n"
    "6sCJ2Q==\n"
    "-----END CERTIFICATE-----\n"
)

CSR_PEM = (
    "-----BEGIN CERTIFICATE REQUEST-----\n"
    "MIHPMHcCAQAwFTETMBEGA1UEAwwKa2NhYXMgbm9kZTBZMBMGByqGSM49AgEGCCqG\n"
    "SM49AwEHA0IABHrZ/dIhJ54qBdqXZ4/5cSpzxJDkBNy3tUtnRVPPHoJmx5xeVN/8\n"
    "R6zODfbSsh6zFMioYTc8LG3ZAbWfSkskLACgADAKBggqhkjOPQQDAgNIADBFAiEA\n"
    "si7mgmRy1KBMAd/EMgvJypdtnARptXqA4aJVfCOpXSUCIGlHihNTDdaufERoCFZr\n"
    "fBxOpRQI271kvjD669LL95rO\n"
    "-----END CERTIFICATE REQUEST-----\n"
)

CERT_PEM = (
    "-----BEGIN CERTIFICATE-----\n"
    "MIIB3jCCAYSgAwIBAgIUIoaXKbxYJVLk1Bl1b0nS2VzjvngwCgYIKoZIzj0EAwIw\n"
    "HDEaMBgGA1UEAwwRS0NhYVMgcGxhdGZvcm0gQ0EwHhcNMjYwMzAyMTQyNTAwWhcN\n"
    "MjYwMzAzMDIzMDAwWjAAMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEetn90iEn\n"
    "nioF2pdnj/lxKnPEkOQE3Le1S2dFU88egmbHnF5U3/xHrM4N9tKyHrMUyKhhNzws\n"
    "bdkBtZ9KSyQsAKOBvzCBvDBcBgNVHREBAf8EUjBQhjhzcGlmZmU6Ly9rY2Fhcy9u\n"
    "b2RlL2MzZDRlNWY2LWE3YjgtNGM5ZC04ZTBmLTFhMmIzYzRkNWU2ZoIUbm9kZS03\n"
    "LmtjYWFzLmV4YW1wbGUwDAYDVR0TAQH/BAIwADAOBgNVHQ8BAf8EBAMCB4AwHQYD\n"
    "VR0lBBYwFAYIKwYBBQUHAwEGCCsGAQUFBwMCMB8GA1UdIwQYMBaAFL5YDaI+119e\n"
    "PGCfCxEPu+5Zp7ImMAoGCCqGSM49BAMCA0gAMEUCIC5qm1U+E1wEjP3fHrakBTyH\n"
    "P0v9INtFwmlGa81zY1QyAiEAiICZz3HaKOzlLkMOPwh2SYD7exMte0cjmj84GB9Z\n"
    "2EY=\n"
    "-----END CERTIFICATE-----\n"
)

RENEWAL_CSR_PEM = (
    "-----BEGIN CERTIFICATE REQUEST-----\n"
    "MIHPMHcCAQAwFTETMBEGA1UEAwwKa2NhYXMgbm9kZTBZMBMGByqGSM49AgEGCCqG\n"
    "SM49AwEHA0IABHrZ/dIhJ54qBdqXZ4/5cSpzxJDkBNy3tUtnRVPPHoJmx5xeVN/8\n"
    "R6zODfbSsh6zFMioYTc8LG3ZAbWfSkskLACgADAKBggqhkjOPQQDAgNIADBFAiEA\n"
    "7G4X83W0AYHMf5YpeVn4xr0PmaSTELFN4B8iCF8v0GkCID3/2uyj+qaa4PaZ/Xa+\n"
    "vzwoidHsF2fiSwsNJnuMyX52\n"
    "-----END CERTIFICATE REQUEST-----\n"
)

RENEWED_CERT_PEM = (
    "-----BEGIN CERTIFICATE-----\n"
    "MIIB3zCCAYSgAwIBAgIUfYwnxiX92kjgKF+lIP9h36ml1RMwCgYIKoZIzj0EAwIw\n"
    "HDEaMBgGA1UEAwwRS0NhYVMgcGxhdGZvcm0gQ0EwHhcNMjYwMzAyMjAyNTAwWhcN\n"
    "MjYwMzAzMDgzMDAwWjAAMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEetn90iEn\n"
    "nioF2pdnj/lxKnPEkOQE3Le1S2dFU88egmbHnF5U3/xHrM4N9tKyHrMUyKhhNzws\n"
    "bdkBtZ9KSyQsAKOBvzCBvDBcBgNVHREBAf8EUjBQhjhzcGlmZmU6Ly9rY2Fhcy9u\n"
    "b2RlL2MzZDRlNWY2LWE3YjgtNGM5ZC04ZTBmLTFhMmIzYzRkNWU2ZoIUbm9kZS03\n"
    "LmtjYWFzLmV4YW1wbGUwDAYDVR0TAQH/BAIwADAOBgNVHQ8BAf8EBAMCB4AwHQYD\n"
    "VR0lBBYwFAYIKwYBBQUHAwEGCCsGAQUFBwMCMB8GA1UdIwQYMBaAFL5YDaI+119e\n"
    "PGCfCxEPu+5Zp7ImMAoGCCqGSM49BAMCA0kAMEYCIQDbXplzGgOoVgwcoWgqGRFg\n"
    "qxLUa+o+LmjH4oZKvKZYSwIhAJFa+Si00uFeKwqy4N3Kd1G3kIcA12C3Pk3OaW6P\n"
    "T6Ez\n"
    "-----END CERTIFICATE-----\n"
)

SEALING_PUBLIC_KEY = "qsN6H0sXka6FeQ6StabE040YS0flSURuCuqLArgNBnc="  # base64 of node-7's X25519 public key
REVOKED_TOKEN = {"jti": "b7c8d9e0-f1a2-4b3c-8d4e-5f6a7b8c9d0e", "exp": 1772462280}  # revoked; expires at 14:38:00Z
RESTARTED_AT = "2026-03-02T14:30:00Z"

REGISTER_REQUEST = OpenApiExample(
    "After a restart, still holding its cache",
    value={
        "endpoint": "node-7.kcaas.example:7443",
        "capacity": CAPACITY,
        "caches": [CACHE_ID],
        "csr": CSR_PEM,
        "sealing_public_key": SEALING_PUBLIC_KEY,
    },
    request_only=True,
)
REGISTERED = OpenApiExample(
    "Registered: its cache confirmed, a certificate issued",
    value={
        "node": {
            **NODE,
            "lease_expires_at": "2026-03-02T14:30:40Z",
            "last_heartbeat_at": RESTARTED_AT,
            "registered_at": RESTARTED_AT,
        },
        "heartbeat_interval_seconds": 10,
        "lease_seconds": 40,
        "caches": [
            {
                "cache_id": CACHE_ID,
                "epoch": 1,
                "state": "ready",
                "capacity": {"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0, "network": 0},
            }
        ],
        "revoked_tokens": [REVOKED_TOKEN],
        "stored_caches": [CACHE_ID],
        "certificate": CERT_PEM,
        "ca_certificate": CA_PEM,
    },
    response_only=True,
    status_codes=["200"],
)
HEARTBEAT_REQUEST = OpenApiExample(
    "Capacity and the resident bytes of its one cache",
    value={
        "capacity": CAPACITY,
        "resident": [
            {
                "cache_id": CACHE_ID,
                "device_bytes": 6 * GIB,
                "dram_bytes": 11 * GIB,
                "ssd_bytes": 0,
                "network_bytes": 0,
                "hit_tokens": 1_843_200,
                "miss_tokens": 412_672,
            }
        ],
    },
    request_only=True,
)
HEARTBEAT_ACK = OpenApiExample(
    "Lease renewed",
    value={
        "state": "ready",
        "lease_expires_at": "2026-03-02T14:30:50Z",
        "heartbeat_interval_seconds": 10,
        "revoked_tokens": [REVOKED_TOKEN],
    },
    response_only=True,
    status_codes=["200"],
)
REREGISTER_REQUIRED = OpenApiExample(
    "A lost node must register again",
    value={
        "error": {
            "code": "reregister_required",
            "message": "This node must register before it heartbeats.",
            "details": {"state": "lost"},
        }
    },
    response_only=True,
    status_codes=["409"],
)
RENEWAL_REREGISTER_REQUIRED = OpenApiExample(
    "A lost node must register again",
    value={
        "error": {
            "code": "reregister_required",
            "message": "This node must register again before renewing its certificate.",
            "details": {"state": "lost"},
        }
    },
    response_only=True,
    status_codes=["409"],
)
RENEW_REQUEST = OpenApiExample("A fresh CSR at half-life", value={"csr": RENEWAL_CSR_PEM}, request_only=True)
RENEWED = OpenApiExample(
    "Renewed: valid until 08:30 tomorrow",
    value={"certificate": RENEWED_CERT_PEM, "ca_certificate": CA_PEM},
    response_only=True,
    status_codes=["200"],
)
CSR_REFUSED = OpenApiExample(
    "A CSR not signed by its own key",
    value={
        "error": {"code": "csr_signature_invalid", "message": "The CSR's signature does not verify.", "details": {}}
    },
    response_only=True,
    status_codes=["400"],
)
PLATFORM_CA = OpenApiExample(
    "The platform CA", value=CA_PEM, response_only=True, status_codes=["200"], media_type="application/x-pem-file"
)
