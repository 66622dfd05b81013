"""Files the node rewrites, committed by many threads at once (gpu_node/tiers/durable_file.py and its users): no commit
fails, none is lost to an older one, no temp file is left, and a store reopened from disk holds exactly what it said.

With one fixed temp name (`index.json.tmp`), the SSD store's writer thread and a delete's `sync` renamed each other's
temp file away (FileNotFoundError: the data plane's `internal` error on a delete) and could interleave two documents
in one temp file."""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from gpu_node.agent.identity import NodeIdentity
from gpu_node.engine.checksum import block_checksum
from gpu_node.tiers import cache_dirs
from gpu_node.tiers.durable_file import CommittedFile, replace_file, stale_temp_files
from gpu_node.tiers.ssd_store import INDEX_NAME, SsdStore

THREADS = 8


def run_threads(target, count: int = THREADS) -> list[BaseException]:
    """Start `count` threads of target(i) together; the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(i: int) -> None:
        barrier.wait()
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_commits_from_many_threads_all_land_and_the_newest_wins(tmp_path):
    committed = CommittedFile(tmp_path / "state.json")
    counter = iter(range(1, 10**6))
    lock = threading.Lock()

    def snapshot() -> bytes:
        with lock:
            return json.dumps({"n": next(counter)}).encode()

    errors = run_threads(lambda i: [committed.commit(snapshot) for _ in range(50)])
    assert not errors, errors
    assert json.loads((tmp_path / "state.json").read_text()) == {"n": THREADS * 50}  # the last snapshot taken
    assert not stale_temp_files(tmp_path, "state.json")
    assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o600


def test_one_shot_writers_of_one_path_never_collide_nor_mix(tmp_path):
    path = tmp_path / "owner"
    contents = {i: (f"writer-{i}:" * 2000).encode() for i in range(THREADS)}
    seen: set[bytes] = set()

    def write(i: int) -> None:
        for _ in range(30):
            replace_file(path, contents[i])
            seen.add(path.read_bytes())

    assert not run_threads(write)
    assert seen <= set(contents.values())  # every read is one writer's whole content
    assert not stale_temp_files(tmp_path, "owner")


def test_an_ssd_store_committed_by_its_writer_and_deletes_at_once_loses_nothing(tmp_path):
    store = SsdStore(str(tmp_path), b"K" * 32, 1 << 26, segment_bytes=1 << 16)
    payload_bytes = 4096
    kept: dict[bytes, bytes] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        for round_ in range(40):
            block_hash = bytes([i, round_]) * 8
            payload = rng.integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
            store.store(block_hash, bytearray(payload), block_checksum(payload), owned=False)
            if round_ % 3 == 0:
                store.discard([block_hash])
                store.sync()  # a delete commits the index while the writer commits after its batch
            else:
                with lock:
                    kept[block_hash] = payload

    errors = run_threads(client)
    assert not errors, errors
    store.flush()
    store.sync()
    assert set(store.hashes()) == set(kept)
    store.close()
    assert not stale_temp_files(tmp_path, INDEX_NAME)

    reopened = SsdStore(str(tmp_path), b"K" * 32, 1 << 26, segment_bytes=1 << 16)
    try:
        assert set(reopened.hashes()) == set(kept)  # nothing deleted came back, nothing kept was lost
        for block_hash, payload in list(kept.items())[:20]:
            assert bytes(reopened.read(block_hash)) == payload
    finally:
        reopened.close()


def test_a_crash_left_temp_file_is_removed_when_the_store_opens(tmp_path):
    (tmp_path / f".{INDEX_NAME}.abc123.tmp").write_text('{"half": ')
    (tmp_path / f"{INDEX_NAME}.tmp").write_text("{")
    SsdStore(str(tmp_path), b"K" * 32, 1 << 20).close()
    assert not stale_temp_files(tmp_path, INDEX_NAME) and not (tmp_path / f"{INDEX_NAME}.tmp").exists()


def test_cache_directory_files_and_the_identity_are_committed_whole(tmp_path):
    directory = tmp_path / "cache-1"
    directory.mkdir()
    assert not run_threads(lambda i: [cache_dirs.write_owner(str(directory), f"tenant-{i}") for _ in range(30)])
    assert (directory / cache_dirs.OWNER_FILE).read_text() in {f"tenant-{i}" for i in range(THREADS)}
    assert os.listdir(directory) == [cache_dirs.OWNER_FILE]

    identity = NodeIdentity()
    assert not run_threads(lambda i: [identity.save(tmp_path / "identity") for _ in range(10)])
    assert NodeIdentity.load(tmp_path / "identity").csr_pem()  # the saved key loads
    assert all(not name.endswith(".tmp") for name in os.listdir(tmp_path / "identity"))
