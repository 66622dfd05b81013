"""Resume after a SIGKILLed migration target (issue 6): the target runs its listener in its own process with the
cache's SSD tier; it is killed with SIGKILL mid-transfer, a new process over the same SSD directory (same cache id,
epoch and keys) republishes what the first one had verified, and the resuming sender sends only the missing blocks.
Real processes, real mutual TLS 1.3, real encrypted SSD segments."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from devtools.dev_pki import new_ca, write_node_pki
from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.journal import JOURNAL_NAME
from gpu_node.migration.transfer import MigrationError, MigrationSender, mtls_client_context
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

REPO = Path(__file__).resolve().parents[3]
KEY, SSD_KEY = b"m" * 32, b"s" * 32
SRC, DST = "6e0de000-0000-4000-8000-0000000000b1", "6e0de000-0000-4000-8000-0000000000b2"
MIGRATION = "6e0de000-0000-4000-8000-0000000000c1"
DURABLE_EVERY = 4


class TargetProcess:
    """tests/gpu_node/migration/migration_target_proc.py in a child process; its stdout lines are read on a thread."""

    def __init__(self, config: dict):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu_node.migration.migration_target_proc", json.dumps(config)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = json.loads(self._next(lambda line: line.startswith("{")))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def _next(self, wanted, timeout: float = 60.0) -> str:
        while True:
            line = self.lines.get(timeout=timeout)
            if wanted(line):
                return line

    def wait_stored(self, count: int) -> None:
        self._next(lambda line: line.startswith("stored ") and int(line.split()[1]) >= count)

    def dump(self, path: Path) -> dict:
        self.process.stdin.write("dump\n")
        self.process.stdin.flush()
        self._next(lambda line: line == "dumped")
        return torch.load(path)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = new_ca("KCaaS platform CA (test)", valid_for=dt.timedelta(hours=1))
    files = {}
    for name, node_id in (("src", SRC), ("dst", DST)):
        (directory / name).mkdir()
        files[name] = write_node_pki(directory / name, ca_key, ca_cert, node_id)
    return files


def source_with_data(spec, num_seqs=6):
    """A device-only source cache whose sequences are whole blocks (every block is full: all go to SSD)."""
    registry = CacheRegistry(device_capacity_bytes=1 << 30, device="cpu")
    engine = registry.provision(
        cache_id="c1", spec=spec, capacity={"device": 64 * spec.block_bytes, "dram": 0, "ssd": 0}, hash_key=KEY, epoch=1
    ).engine
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 50_000, size=4 * spec.block_size).astype(np.int32) for _ in range(num_seqs)]
    for tokens in seqs:
        assert engine.put(tokens, prefix_kv(spec, tokens)).num_cached_tokens == len(tokens)
    return engine, seqs


def target_config(spec, pki, tmp_path, seqs) -> dict:
    capacity = {"device": 64 * spec.block_bytes, "dram": 0, "ssd": 256 * spec.block_bytes}
    return {
        "ssd_dir": str(tmp_path / "ssd"),
        "cache_id": "c1",
        "epoch": 2,
        "migration_id": MIGRATION,
        "source_node_id": SRC,
        "capacity": capacity,
        "hash_key_hex": KEY.hex(),
        "ssd_key_hex": SSD_KEY.hex(),
        "spec": dataclasses.asdict(spec),
        "pki": pki["dst"],
        "durable_every": DURABLE_EVERY,
        "sequences": [s.tolist() for s in seqs],
        "dump": str(tmp_path / "dump.pt"),
    }


def sender(engine, endpoint, pki, hook=None) -> MigrationSender:
    return MigrationSender(
        engine,
        migration_id=MIGRATION,
        cache_id="c1",
        epoch=2,
        target_endpoint=endpoint,
        target_node_id=DST,
        tls_context=mtls_client_context(
            **{"cert_file": pki["src"]["cert"], "key_file": pki["src"]["key"], "ca_file": pki["src"]["ca"]}
        ),
        corrupt=hook,
        connect_timeout=5,
    )


def kill_after(target: TargetProcess, count: int):
    """A per-block sender hook: before block `count` leaves, wait until the target verified `count` blocks (a
    multiple of DURABLE_EVERY: all durable), then SIGKILL it. Never corrupts anything."""

    def hook(_key: bytes) -> bool:
        hook.calls += 1
        if hook.calls == count + 1:
            target.wait_stored(count)
            target.kill()
        return False

    hook.calls = 0
    return hook


def test_sigkilled_target_resumes_from_its_ssd_without_resends(pki, tmp_path):
    spec = tiny_spec()
    src, seqs = source_with_data(spec)
    total = len(bt.snapshot(src))
    cut = (total // 2) // DURABLE_EVERY * DURABLE_EVERY
    config = target_config(spec, pki, tmp_path, seqs)
    first_target = TargetProcess(config)
    assert first_target.ready["restored"] == 0
    first = sender(src, first_target.ready["endpoint"], pki, hook=kill_after(first_target, cut))
    try:
        with pytest.raises((OSError, MigrationError)):
            first.run()
    finally:
        first_target.kill()
    assert (tmp_path / "ssd" / "c1" / JOURNAL_NAME).exists()
    second_target = TargetProcess(config)  # a fresh process: its device pool starts empty, the SSD rescans
    try:
        assert second_target.ready["restored"] == cut  # every block verified before the kill is held again
        second = sender(src, second_target.ready["endpoint"], pki).run()
        dumped = second_target.dump(tmp_path / "dump.pt")
    finally:
        second_target.kill()
    assert second.blocks_sent == total - cut  # only the missing blocks crossed the wire
    assert not set(first.stats.keys_sent[:cut]) & set(second.keys_sent)
    for i, tokens in enumerate(seqs):
        n, kv = dumped[i]
        assert n == len(tokens) and torch.equal(kv, prefix_kv(spec, tokens))  # bit-exact on the target


def test_journal_of_another_migration_is_not_replayed(pki, tmp_path):
    spec = tiny_spec()
    src, seqs = source_with_data(spec, num_seqs=2)
    config = target_config(spec, pki, tmp_path, seqs)
    target = TargetProcess(config)
    try:
        sender(src, target.ready["endpoint"], pki).run()
    finally:
        target.kill()
    other = TargetProcess(dict(config, migration_id="6e0de000-0000-4000-8000-0000000000c2"))
    try:
        assert other.ready["restored"] == 0  # a stale journal never counts for another migration
    finally:
        other.kill()
