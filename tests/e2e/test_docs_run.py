"""The docs run as written, in order, on one `make up` (tests/e2e/docs_run.py turns their blocks into one bash
session): the README's first session (make up listening where KCAAS_URL says, `make demo` reporting hits);
docs/first-hour.md from the operator's `make up` through onboarding a tenant (`kcaas admin`) to that tenant's vLLM
engine hitting the cache, and transformers reading the KV vLLM stored; docs/sdk.md; docs/vllm.md. `make up` runs on
the embedded defaults in the test's own var/ directory, on a free port; the model is a tiny random Llama built
offline."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import docs_run
from tests.e2e.up_support import REPO, SERVICE_ENV, make_recipe
from tests.e2e.vllm_support import requires_vllm, vllm_models  # noqa: F401 - fixture
from tests.faults import free_port

ALL_PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
SESSION_TIMEOUT_S = 1500


def test_every_fenced_block_of_the_docs_says_what_it_is():
    """An unlabelled block could hide a command from the run: each says `sh`/`bash`/`python` (run) or what else
    it is (`text` for output, diagrams and formats; `json`, ...)."""
    assert docs_run.unlabelled_blocks(ALL_PAGES) == []


def test_every_page_with_commands_is_in_the_run():
    outside = [
        block.where
        for page in ALL_PAGES
        if page not in docs_run.PAGES
        for block in docs_run.blocks(page)
        if block.lang in docs_run.RUNNABLE
    ]
    assert outside == [], "add the page to docs_run.PAGES (in reading order), or say what the blocks are"


def test_a_block_not_run_says_why():
    for page in docs_run.PAGES:
        for block in docs_run.blocks(page):
            assert block.not_run is None or len(block.not_run) > 20, f"{block.where}: say why it is not run"


def test_the_session_script_stands_in_only_for_make_up_and_printed_lines():
    script, ran = docs_run.session_script(("docs/first-hour.md",), {"/models/my-llama": "/tmp/m"}, prelude="")
    assert "/models/my-llama" not in script and "/tmp/m" in script
    assert '_printed="$(printed_export KCAAS_URL KCAAS_API_KEY)"; eval "$_printed"' in script
    placeholders = [line for line in script.splitlines() if "kc_live_..." in line]
    assert placeholders and all(line.startswith("_printed=") for line in placeholders)  # each stood in for
    assert {block.lang for block in ran} == {"sh", "python"}


def _prelude(port: int, var: Path, up_log: Path, session_log: Path) -> str:
    """`make up` in the background (a reader's first terminal; a second `make up` finds it running), `make demo`
    as its recipe, `printed_export` reading what the session printed."""
    return f"""set -euo pipefail
cd {REPO}
make() {{
  case "$1" in
    up)
      if [ -z "${{KCAAS_DOCS_UP:-}}" ]; then
        KCAAS_URL=http://127.0.0.1:{port} {make_recipe("up")} > {up_log} 2>&1 &
        KCAAS_DOCS_UP=$!
        for _ in $(seq 360); do
          grep -q "{docs_run.BANNER_END}" {up_log} && return 0
          kill -0 "$KCAAS_DOCS_UP" 2> /dev/null || {{ tail -40 {up_log}; return 1; }}
          sleep 0.5
        done
        echo "make up printed no banner in 180 s"; return 1
      fi ;;
    demo) {make_recipe("demo")} ;;
    *) command make "$@" ;;
  esac
}}
printed_export() {{ KCAAS_DOCS_LOGS={up_log}:{session_log} {sys.executable} {docs_run.__file__} printed-export "$@"; }}
"""


@requires_vllm
def test_the_docs_run_as_written_in_order_on_one_make_up(tmp_path, vllm_models):
    port, vllm_port = free_port(), free_port()
    var, up_log, session_log = tmp_path / "var", tmp_path / "up.log", tmp_path / "session.log"
    substitutions = {
        "127.0.0.1:8000": f"127.0.0.1:{port}",
        "127.0.0.1:8100": f"127.0.0.1:{vllm_port}",
        "--port 8100": f"--port {vllm_port}",
        "/models/my-llama": vllm_models["llama"],
        "var/secrets/": f"{var}/secrets/",
    }
    script, ran = docs_run.session_script(docs_run.PAGES, substitutions, _prelude(port, var, up_log, session_log))
    (tmp_path / "session.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_ENV and not k.startswith("KCAAS_")}
    venv_bin = str(Path(sys.executable).parent)  # as in a fresh shell: the docs' `source .venv/bin/activate` adds it
    env.update(KCAAS_VAR_DIR=str(var), PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin))
    made_here = [REPO / name for name in ("spec.json", "vllm.log") if not (REPO / name).exists()]  # the docs write them
    with open(session_log, "w") as log:
        session = subprocess.Popen(
            ["bash", str(tmp_path / "session.sh")],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            session.wait(timeout=SESSION_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the docs did not finish in {SESSION_TIMEOUT_S} s:\n{session_log.read_text()[-6000:]}")
        finally:
            try:
                os.killpg(session.pid, signal.SIGKILL)  # make up, vLLM: everything the session started
            except ProcessLookupError:
                pass
            for path in made_here:  # kept beside the session's log
                if path.exists():
                    shutil.move(path, tmp_path / path.name)
    printed = session_log.read_text(errors="replace")
    failure = f"the docs stopped (see {tmp_path}/session.sh):\n{printed[-8000:]}\n--- make up:\n"
    assert session.returncode == 0 and "### the docs ran to the end" in printed, failure + up_log.read_text()[-3000:]
    for block in ran:
        assert block.where in printed, f"{block.where} did not run"

    turns = [int(n) for n in re.findall(r"^turn \d+ prompt tokens 300 from KCaaS (\d+)$", printed, re.MULTILINE)]
    assert len(turns) == 3 and turns[0] == 0 and turns[-1] == 288, printed[-4000:]  # the tenant's vLLM hits
    assert re.search(r"hit rate\s+[1-9][\d.]*%", printed)  # make demo
    assert re.search(r"\bmy-llama\b.*\bready\b", printed)  # kcaas ls, as the tenant
    assert "PrefixReuse(num_prompt_tokens=300, num_cached_tokens=288)" in printed  # transformers reads vLLM's KV


def test_make_demo_pointed_where_nothing_listens_names_kcaas_url(tmp_path):
    nowhere = subprocess.run(
        make_recipe("demo").split(),
        cwd=REPO,
        env={
            **{k: v for k, v in os.environ.items() if k not in SERVICE_ENV and not k.startswith("KCAAS_")},
            "KCAAS_URL": f"http://127.0.0.1:{free_port()}",
            "KCAAS_API_KEY": "kc_live_" + "x" * 60,
            "KCAAS_VAR_DIR": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert nowhere.returncode != 0 and "KCAAS_URL" in nowhere.stderr, nowhere.stderr
