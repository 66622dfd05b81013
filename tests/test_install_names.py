"""What an install puts on the import path: nothing of ours shadows a package the field owns, nor is shadowed by one.

- transformers >= 5.25 imports Hugging Face's `kernels`; the node imports the project's kernels as `kcaas_kernels`.
  Both, with a real Llama forward and the in-process engine reusing a prefix, in one process started from the
  repository root and from another directory (either cwd broke when the project's kernels were named `kernels`).
- `pip install kcaas` (the SDK wheel) installs one top-level package, `kcaas`: no server room in an engine's
  environment.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from tests.e2e.sglang_support import sglang_python
from tests.e2e.vllm_support import vllm_python

REPO = Path(__file__).resolve().parents[1]

# One process: Hugging Face's kernels beside ours, a Llama config and forward, and the in-process engine (it imports
# kcaas_kernels) serving a prefix to the transformers connector, whose logits must equal the model alone.
BESIDE_TRANSFORMERS = r"""
import json, sys
import torch, transformers, kernels, kcaas_kernels
from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector
from kcaas.spec import KVCacheSpec

torch.manual_seed(0)
torch.set_num_threads(1)
# the shapes of tests/e2e/test_tiny_llama_prefix_reuse.py, on which eager attention is exact across lengths
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  attn_implementation="eager")
model = transformers.LlamaForCausalLM(config).eval()
spec = KVCacheSpec.from_hf_config(config, model_fingerprint="tiny-llama@seed0", block_size=16, dtype="float32")
engine = PagedKVCache(spec, hash_key=b"k" * 32, num_blocks=16, device="cpu")
connector = HFConnector(model, engine, read_only=False)
prompt = torch.randint(0, 128, (1, 39), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    alone = model(prompt).logits
    connector.forward(prompt[:, :30])  # stores the first 30 tokens' KV (a full block and a partial one)
    reused = connector.forward(prompt)
cached = connector.last_reuse.num_cached_tokens
print(json.dumps({
    "hf_kernels": kernels.__file__,
    "kcaas_kernels": kcaas_kernels.__file__,
    "cached": cached,
    "equal": bool(torch.equal(alone[:, cached:], reused.logits)),
}))
"""


@pytest.mark.parametrize("where", ["repository root", "another directory"])
def test_hugging_face_kernels_and_ours_live_side_by_side(where, tmp_path):
    if Version(importlib.metadata.version("transformers")) < Version("5.25"):
        pytest.fail("the lock must hold transformers >= 5.25 (the release that imports Hugging Face's `kernels`)")
    cwd = REPO if where == "repository root" else tmp_path
    done = subprocess.run(
        [sys.executable, "-c", BESIDE_TRANSFORMERS], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert Path(found["hf_kernels"]).resolve() == site_packages / "kernels" / "__init__.py", found  # Hugging Face's
    assert Path(found["kcaas_kernels"]).resolve() == REPO / "kernels" / "kcaas_kernels" / "__init__.py"
    assert found["cached"] == 30 and found["equal"], found


# Every module of every room (tests/test_layering.py's list) in one process, after transformers has loaded its
# `kernels`; the vLLM connector's modules import vllm, which lives in the engine's venv (`make vllm-venv`), and the
# SGLang backend imports sglang, which lives in its own (`make sglang-venv`; its helper modules import here).
EVERY_ROOM = r"""
import importlib, json, sys
import django
django.setup()
import transformers, kernels
transformers.LlamaConfig()
from tests.test_layering import modules
failed = {}
for name in sorted(modules()):
    if name.endswith("__main__") or name.startswith("kcaas.connectors.vllm") or name == "kcaas.connectors.sglang":
        continue
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = repr(exc)[:300]
print(json.dumps({"modules": len(modules()), "failed": failed, "kernels": sys.modules["kernels"].__file__}))
"""


def test_every_room_imports_in_one_process_beside_transformers(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
        "KCAAS_VAR_DIR": str(tmp_path / "var"),
    }
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", EVERY_ROOM],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["modules"] > 200 and not found["failed"], found["failed"]
    assert Path(found["kernels"]).resolve().parent.parent == Path(sysconfig.get_paths()["purelib"]).resolve()


def test_the_sdk_wheel_installs_only_the_kcaas_package(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("kcaas-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert top_level - dist_info == {"kcaas"}, sorted(top_level)
    assert "kcaas/connectors/vllm.py" in names and "kcaas/connectors/hf.py" in names
    assert not [name for name in names if name.endswith((".so", ".c"))], "no compiled server code in the SDK"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_venv_has_the_sdk_and_no_server_room(engine, tmp_path):
    """.venv-vllm and .venv-sglang are engines' environments (their lock, then the SDK): the connector imports against
    the engine, and no server room, nor anything of ours named `kernels`, is importable there from another
    directory."""
    python = vllm_python() if engine == "vllm" else sglang_python()
    probe = (
        f"import importlib.util, json, kcaas.connectors.{engine}\n"
        "names = ('gpu_node', 'kcaas_kernels', 'kernels', 'tenants', 'audit', 'bench', 'core', 'controlplane')\n"
        "print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None) for n in names}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "TRITON_INTERPRET")}
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {name: origin for name, origin in found.items() if origin and _in_checkout(Path(origin))}
    assert not ours, f"server rooms importable in the engine's environment: {ours}"


def _in_checkout(path: Path) -> bool:
    """Whether `path` is the checkout's own source (not a venv's site-packages that happens to live under it)."""
    path = path.resolve()
    return path.is_relative_to(REPO) and not path.relative_to(REPO).parts[0].startswith(".venv")
