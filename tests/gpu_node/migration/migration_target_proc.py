"""A migration target in its own process, so a test can SIGKILL it mid-transfer (run with -m; no Django).

argv[1]: JSON config {ssd_dir, cache_id, epoch, migration_id, source_node_id, capacity, hash_key_hex, ssd_key_hex,
spec (KVCacheSpec fields), pki {cert, key, ca}, durable_every, sequences (token lists), dump (a .pt path)}.

Prints one line `{"endpoint", "restored"}` once the listener accepts the migration, then `stored <n>` every time
the listener's count of verified blocks changes. On stdin `dump` it writes {i: (num tokens, KV)} of `get()` for
every configured sequence to the dump path and prints `dumped`.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import torch

from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration.transfer import Incoming, MigrationListener, mtls_server_context
from kcaas.spec import KVCacheSpec


def _serve(config: dict) -> tuple[MigrationListener, CacheRegistry]:
    registry = CacheRegistry(device_capacity_bytes=1 << 30, device="cpu", ssd_dir=config["ssd_dir"])
    registry.provision(
        cache_id=config["cache_id"],
        spec=KVCacheSpec(**config["spec"]),
        capacity=config["capacity"],
        hash_key=bytes.fromhex(config["hash_key_hex"]),
        epoch=config["epoch"],
        tenant_id="t1",
        ssd_key=bytes.fromhex(config["ssd_key_hex"]),
    )
    pki = config["pki"]
    listener = MigrationListener(
        registry, mtls_server_context(pki["cert"], pki["key"], pki["ca"]), durable_every=config["durable_every"]
    ).start()
    listener.expect(Incoming(config["migration_id"], config["cache_id"], config["source_node_id"], config["epoch"]))
    return listener, registry


def _report_stored(listener: MigrationListener) -> None:
    seen = -1
    while True:
        stored = listener.stats.blocks_stored
        if stored != seen:
            print(f"stored {stored}", flush=True)
            seen = stored
        time.sleep(0.005)


def _dump(config: dict, registry: CacheRegistry) -> None:
    engine = registry.get(config["cache_id"]).engine
    out = {}
    for i, tokens in enumerate(config["sequences"]):
        n, kv = engine.get(np.asarray(tokens, dtype=np.int32))
        out[i] = (n, kv.clone() if kv is not None else None)
    torch.save(out, config["dump"])
    print("dumped", flush=True)


def main() -> None:
    config = json.loads(sys.argv[1])
    listener, registry = _serve(config)
    print(json.dumps({"endpoint": listener.endpoint, "restored": listener.stats.blocks_restored}), flush=True)
    threading.Thread(target=_report_stored, args=(listener,), daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "dump":
            _dump(config, registry)


if __name__ == "__main__":
    main()
