"""Response examples for the audit room's public operation of the published reference."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample

PLATFORM_KEY = OpenApiExample(
    "The platform key",
    value={
        "kty": "OKP",
        "crv": "Ed25519",
        "x": "yR1yqLEnqnl5xgbShUCkSggZOUZK0J6_8i_d-OPK67I",
        "kid": "fvDo0ZIQVKt4Yz-OZqrtmKgP576SRbLXDkMitqCJILU",
        "use": "sig",
        "alg": "EdDSA",
    },
    response_only=True,
    status_codes=["200"],
)
