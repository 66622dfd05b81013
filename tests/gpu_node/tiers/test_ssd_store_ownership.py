"""One live SSD store per cache directory, and a writer that fails says so.

- A second store of a directory a live store holds is refused with a clear error (cache_dirs.DirectoryInUse); once
  the first is closed or wiped (or its process dies) the directory opens again.
- The removal paths (cache_dirs.take, purge_tenant_directories, delete_leftovers, the registry's clean-up at
  registration) leave alone a directory that a live store of ANOTHER PROCESS holds (a real child process holding
  it: its flock is what they see), and remove it once that process has let go, by exiting or by a SIGKILL.
- A writer thread that hits a real fault (its cache directory removed under it, so the index commit fails) is
  logged at CRITICAL; flush and sync then raise SsdWriterFailed (they neither hang nor return as if the blocks were
  durable) and later stores raise too, zeroing the payload handed over.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_node.agent.registry import CacheRegistry
from gpu_node.engine.checksum import block_checksum
from gpu_node.tiers import cache_dirs
from gpu_node.tiers.ssd_store import SsdStore, SsdWriterFailed

REPO = Path(__file__).resolve().parents[3]
KEY = b"K" * 32
TENANT = "tenant-1"
CACHE_ID = "cache-1"

HOLDER = textwrap.dedent("""
    import os
    import sys
    from gpu_node.tiers import cache_dirs
    from gpu_node.tiers.ssd_store import SsdStore
    root, cache_id, tenant = sys.argv[1:4]
    directory = os.path.join(root, cache_id)
    store = SsdStore(directory, b"K" * 32, 1 << 20)
    cache_dirs.write_owner(directory, tenant)
    print("held", flush=True)
    sys.stdin.readline()  # until the test lets go
    store.close()
""")


def block(seed: int) -> tuple[bytes, bytearray]:
    payload = bytearray(os.urandom(256))
    return bytes([seed]) * 16, payload


class Holder:
    """A child process with an open SsdStore on <root>/<cache id> (owned by TENANT)."""

    def __init__(self, root: Path, cache_id: str = CACHE_ID):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(root), cache_id, TENANT],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline()  # blocks until the store is open (or the child failed)
        assert line == "held\n", f"the holder did not open its store: {line!r}"

    def let_go(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(timeout=30) == 0

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


@pytest.fixture
def holders():
    started: list[Holder] = []
    yield lambda *args: started.append(Holder(*args)) or started[-1]
    for holder in started:
        if holder.process.poll() is None:
            holder.kill()


def test_a_second_store_of_a_live_directory_is_refused_until_the_first_lets_go(tmp_path):
    directory = str(tmp_path / CACHE_ID)
    first = SsdStore(directory, KEY, 1 << 20)
    with pytest.raises(cache_dirs.DirectoryInUse, match="held by another live store"):
        SsdStore(directory, KEY, 1 << 20)
    assert cache_dirs.held(directory)
    first.close()
    assert not cache_dirs.held(directory)
    second = SsdStore(directory, KEY, 1 << 20)  # closed: it opens again (warm restart)
    second.wipe()
    third = SsdStore(directory, KEY, 1 << 20)  # wiped: a fresh directory
    third.close()


def test_removal_and_purge_skip_a_directory_another_process_holds(tmp_path, holders):
    root = tmp_path / "ssd"
    holder = holders(root)
    directory = root / CACHE_ID
    assert cache_dirs.held(str(directory))
    with pytest.raises(cache_dirs.DirectoryInUse):
        SsdStore(str(directory), KEY, 1 << 20)
    assert cache_dirs.take(str(root), CACHE_ID) is None
    assert cache_dirs.purge_tenant_directories(str(root), TENANT) == []
    registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu", ssd_dir=str(root))
    assert registry.remove_unplaced_directories([]) == []
    assert (directory / cache_dirs.OWNER_FILE).is_file()  # untouched by all of them

    holder.let_go()
    assert cache_dirs.purge_tenant_directories(str(root), TENANT) == [CACHE_ID]
    assert os.listdir(root) == []


def test_a_killed_holder_leaves_no_stale_lock(tmp_path, holders):
    root = tmp_path / "ssd"
    holders(root).kill()  # SIGKILL: the kernel drops the flock with the process
    assert not cache_dirs.held(str(root / CACHE_ID))
    registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu", ssd_dir=str(root))
    assert registry.remove_unplaced_directories([]) == [CACHE_ID]
    assert os.listdir(root) == []


def test_leftovers_of_a_removal_are_deleted_but_never_a_held_directory(tmp_path, holders):
    root = tmp_path / "ssd"
    held_name = f"{cache_dirs.REMOVED_PREFIX}{CACHE_ID}-held"
    holder = holders(root, held_name)  # a store holding a directory whose name looks like a leftover
    (root / f"{cache_dirs.REMOVED_PREFIX}other-1234").mkdir()
    cache_dirs.delete_leftovers(str(root))
    assert os.listdir(root) == [held_name]
    holder.let_go()
    cache_dirs.delete_leftovers(str(root))
    assert os.listdir(root) == []


def test_a_writer_that_dies_fails_flush_sync_and_later_stores(tmp_path, caplog):
    directory = tmp_path / CACHE_ID
    store = SsdStore(str(directory), KEY, 1 << 20)
    first_hash, first = block(1)
    store.store(first_hash, first, block_checksum(first))
    store.flush()  # written and committed
    assert store.bytes_resident == len(first)

    shutil.rmtree(directory)  # a real fault: the directory goes away under the live store
    second_hash, second = block(2)
    with caplog.at_level(logging.CRITICAL, logger="gpu_node.tiers.ssd_store"):
        store.store(second_hash, second, block_checksum(second))
        with pytest.raises(SsdWriterFailed, match="SSD writer of .* failed"):
            store.flush()
    assert any(r.levelno == logging.CRITICAL and "died" in r.getMessage() for r in caplog.records)
    with pytest.raises(SsdWriterFailed):
        store.sync()
    third_hash, third = block(3)
    with pytest.raises(SsdWriterFailed):
        store.store(third_hash, third, block_checksum(third))
    assert third == bytearray(len(third))  # the refused payload was zeroed, not left in memory
    assert not store.contains(third_hash)
    with pytest.raises(SsdWriterFailed):
        store.flush()  # and it stays failed, without hanging
    store.close()
