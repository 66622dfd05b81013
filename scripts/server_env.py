"""Make the running interpreter's environment a KCaaS server environment: the checkout on its path, the C hash built.

    .venv/bin/python scripts/server_env.py

The server rooms (gpu_node, the kernels' package kcaas_kernels, tenants, audit, bench) are never installed as
packages: `pip install kcaas` is the SDK alone (pyproject.toml). A server environment is this checkout: a
`kcaas-server.pth` in the environment's site-packages puts the repository root and `kernels/` (the folder that holds
the `kcaas_kernels` package) on every interpreter's path, whatever its working directory, as PYTHONPATH does in the
image. `platform/` stays off it: its rooms (core, console, ...) have generic names, and the processes that need them
(manage.py, pytest, the Celery worker) put it on their own path.

It also builds gpu_node/engine/_blockhash.c (the prefix-hash loop) next to its source, as `gpu_node.engine._blockhash`;
gpu_node/engine/block_hash.py falls back to hashlib without it. Idempotent: run by `make install` after each lock
install.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PTH_NAME = "kcaas-server.pth"
PATH_ENTRIES = (REPO, REPO / "kernels")


def write_pth() -> Path:
    """Write the .pth naming the checkout's import roots; returns its path."""
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    pth.write_text("".join(f"{entry}\n" for entry in PATH_ENTRIES))
    return pth


def build_blockhash() -> None:
    """Compile gpu_node/engine/_blockhash.c in place (setuptools' build_ext, the interpreter's own compiler flags)."""
    from setuptools import Distribution, Extension

    extension = Extension("gpu_node.engine._blockhash", ["gpu_node/engine/_blockhash.c"], extra_compile_args=["-O2"])
    dist = Distribution({"name": "kcaas-server", "ext_modules": [extension]})
    dist.verbose = 0
    command = dist.get_command_obj("build_ext")
    command.inplace = True
    command.build_temp = str(REPO / "build" / "temp")
    command.ensure_finalized()
    command.run()


def main() -> None:
    import os

    os.chdir(REPO)
    pth = write_pth()
    build_blockhash()
    entries = ", ".join(str(entry) for entry in PATH_ENTRIES)
    print(f"server environment: {pth} -> {entries}; gpu_node.engine._blockhash built")


if __name__ == "__main__":
    main()
