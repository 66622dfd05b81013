"""Fixtures for the network tier's store (Mooncake Store: a master and store servers as real processes on loopback,
devtools.store_services). Registered in tests/conftest.py, so any test may name them:

- `network_store` (session scope): one store for the whole run; yields its `StoreEndpoints` (master, metadata_url).
  Tests share it, so each must use keys of its own and must not stop or kill it.
- `fresh_network_store` (per test): a store of the test's own; yields the started `StoreServices`, whose
  `kill_store_server(i)`, `stop_master()` / `resume_master()` and `kill_master()` a test may call; its endpoints are
  `.endpoints`. Its master drops a dead store server (and the objects it held) after 2 s without a heartbeat.

Both skip, with the reason, only when the `mooncake` package is not importable (the `network` extra, Linux x86_64);
a store that is installed but does not start fails the test. Every process is stopped when the fixture ends.
"""

from __future__ import annotations

import pytest

from devtools.store_services import MIB, StoreServices, mooncake_importable

SKIP_REASON = (
    "the network tier's store is not installed: the `mooncake` package (mooncake-transfer-engine-non-cuda, "
    "pip extra `network`, Linux x86_64 only) is not importable"
)


def require_mooncake() -> None:
    if not mooncake_importable():
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def network_store(tmp_path_factory):
    """The run's shared store: one master and one store server with a 256 MiB segment."""
    require_mooncake()
    services = StoreServices(tmp_path_factory.mktemp("network-store"), segment_bytes=256 * MIB)
    try:
        yield services.start()
    finally:
        services.stop()


@pytest.fixture
def fresh_network_store(tmp_path):
    """A store of this test's own (one store server, 64 MiB), for tests that kill or stop its processes."""
    require_mooncake()
    services = StoreServices(tmp_path / "network-store", segment_bytes=64 * MIB, client_ttl_s=2)
    try:
        services.start()
        yield services
    finally:
        services.stop()
