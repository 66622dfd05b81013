"""docs/sdk.md cannot rot: every ```python block of it runs, in order and in one namespace (as one script), against
the real service: the live control plane, the control queue's worker and a node agent process serving TLS 1.3 with a
certificate from a CA the control plane publishes (tests/e2e's fixtures). KCAAS_URL and KCAAS_API_KEY are set as the
page tells the reader to set them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import agent, agent_launcher, control_worker, model, pki, tenant_key  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
PAGE = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


def test_the_page_has_the_examples_it_promises():
    text = "\n".join(python_blocks())
    for needed in ("kcaas.connect()", "from_hf_config", "kc.cache(", ".put(", ".get(", ".lookup(", "hint", "ca="):
        assert needed in text, f"docs/sdk.md has no runnable example using {needed}"


def test_every_python_block_of_docs_sdk_runs(live_server, agent, settings, pki, monkeypatch, capsys):
    settings.KCAAS_DATA_PLANE_CA_FILE = pki["ca"]  # published as `make up` publishes its dev CA
    monkeypatch.setenv("KCAAS_URL", live_server.url)
    monkeypatch.setenv("KCAAS_API_KEY", tenant_key())
    namespace: dict = {"__name__": "docs_sdk"}
    blocks = python_blocks()
    for index, source in enumerate(blocks, 1):
        code = compile(source, f"docs/sdk.md python block {index} of {len(blocks)}", "exec")
        exec(code, namespace)  # a failure's traceback names the block and its line
    printed = capsys.readouterr().out
    assert "forbidden" in printed and "no_capacity" in printed and "KCAAS_API_KEY" in printed
    assert namespace["cache"].state == "ready" and namespace["kc"].client.get_cache(namespace["cache"].id).state in (
        "detaching",
        "detached",
    )
