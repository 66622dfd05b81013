"""The locks (locks/*.txt) are complete, hashed, agree with pyproject.toml's ranges, and are what this venv holds.

A lock that no longer satisfies pyproject (a range changed without `make lock`), a pin without a hash, an image lock
that drifts from the tested one, or a venv that is not the lock (a stale or hand-upgraded environment) fails here.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
# Each lock and the pyproject extras it is compiled from (Makefile, `make lock`).
LOCK_EXTRAS = {
    "main.txt": ("control", "node", "gpu", "dev", "network", "hf"),
    "server.txt": ("control", "node", "gpu", "network"),
    "vllm.txt": ("vllm",),
    "sglang.txt": (),  # hand-kept (locks/sglang.in): its requirements are that file's, checked below
}
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+?)(?:\s*;.*?)?\s*\\?$")


def pins(lock: str) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of every `name==version` entry of a lock file."""
    found: dict[str, tuple[str, int]] = {}
    current = None
    for line in (LOCKS / lock).read_text().splitlines():
        if match := PIN.match(line):
            current = canonicalize_name(match.group(1))
            found[current] = (match.group(2), 0)
        elif current and line.strip().startswith("--hash=sha256:"):
            version, count = found[current]
            found[current] = (version, count + 1)
        elif not line.startswith(" "):
            current = None
    return found


def extra_requirements(extra: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["optional-dependencies"][extra]]


@pytest.mark.parametrize("lock", sorted(LOCK_EXTRAS))
def test_every_pin_is_hashed(lock):
    locked = pins(lock)
    assert len(locked) > 5, f"{lock}: no pins read"
    unhashed = sorted(name for name, (_, hashes) in locked.items() if hashes == 0)
    assert not unhashed, f"{lock}: pinned without a hash: {unhashed}"


@pytest.mark.parametrize("lock", sorted(LOCK_EXTRAS))
def test_the_lock_satisfies_pyproject(lock):
    locked = pins(lock)
    problems = []
    for extra in LOCK_EXTRAS[lock]:
        for requirement in extra_requirements(extra):
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            name = canonicalize_name(requirement.name)
            if name not in locked:
                problems.append(f"[{extra}] {requirement}: not in the lock")
            elif not requirement.specifier.contains(Version(locked[name][0]), prereleases=True):
                problems.append(f"[{extra}] {requirement}: the lock has {locked[name][0]}")
    assert not problems, f"{lock} is stale (run `make lock`):\n" + "\n".join(problems)


def test_the_sglang_lock_pins_what_its_input_names_and_shares_the_vllm_pins():
    """locks/sglang.txt is written by hand: every requirement of locks/sglang.in is in it at an allowed version, and
    a package both engine locks hold has one version and as many hashes (copied: one wheel in pip's cache)."""
    locked = pins("sglang.txt")
    lines = [line.split("#")[0].strip() for line in (LOCKS / "sglang.in").read_text().splitlines()]
    wanted = [Requirement(line) for line in lines if line]
    problems = [
        str(r)
        for r in wanted
        if canonicalize_name(r.name) not in locked
        or not r.specifier.contains(Version(locked[canonicalize_name(r.name)][0].split("+")[0]), prereleases=True)
    ]
    assert not problems, f"locks/sglang.txt does not satisfy locks/sglang.in: {problems}"
    vllm = pins("vllm.txt")
    drift = {name: (pin, vllm[name]) for name, pin in locked.items() if name in vllm and vllm[name] != pin}
    assert not drift, f"locks/sglang.txt and locks/vllm.txt pin these differently: {drift}"


def test_the_image_lock_is_a_subset_of_the_tested_lock():
    main, server = pins("main.txt"), pins("server.txt")
    drift = {name: (version, main.get(name, (None,))[0]) for name, (version, _) in server.items()}
    drift = {name: pair for name, pair in drift.items() if pair[0] != pair[1]}
    assert not drift, f"locks/server.txt pins what locks/main.txt does not (image vs tested): {drift}"


def test_this_venv_is_exactly_the_main_lock():
    """What `make install` installed is the lock: same names, same versions (the SDK itself aside)."""
    installed = {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    installed.pop("kcaas", None)
    locked = {name: version for name, (version, _) in pins("main.txt").items()}
    differ = {
        name: (installed.get(name), version) for name, version in locked.items() if installed.get(name) != version
    }
    extra = sorted(set(installed) - set(locked))
    assert not differ and not extra, f"venv vs locks/main.txt: differ {differ}, not in the lock {extra}"
