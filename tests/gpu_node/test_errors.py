"""The node's one error hierarchy (gpu_node/errors.py): every exception class the node defines is a NodeError, each
carries the wire code its data-plane answer says, and an answer never carries a node failure's own text."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from gpu_node.engine.cache_state import CachePurged
from gpu_node.engine.kv_input import KVNotStorable
from gpu_node.engine.put_plan import PrefixNotCached
from gpu_node.errors import NOT_FOUND_MESSAGE, NodeError, answer_error
from gpu_node.tiers.ssd_store import SsdWriterFailed
from kcaas.wire import ErrorCode, ProtocolError

NODE = Path(__file__).resolve().parents[2] / "gpu_node"


def defined_exceptions() -> list[type]:
    """Every class in gpu_node whose name says it is an error, or that derives from an exception class."""
    found = []
    for path in sorted(NODE.rglob("*.py")):
        module_name = ".".join(path.relative_to(NODE.parent).with_suffix("").parts).removesuffix(".__init__")
        if module_name.endswith("__main__"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                cls = getattr(importlib.import_module(module_name), node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append(cls)
    return found


def test_every_exception_the_node_defines_is_a_node_error_or_a_wire_error():
    classes = defined_exceptions()
    assert len(classes) >= 12
    stray = [f"{cls.__module__}.{cls.__name__}" for cls in classes if not issubclass(cls, NodeError | ProtocolError)]
    assert not stray, f"outside the hierarchy: {stray}"
    assert all(isinstance(cls.code, ErrorCode) for cls in classes if issubclass(cls, NodeError))


@pytest.mark.parametrize(
    "error, code, message, details",
    [
        (CachePurged("purged while read: tenant t, 3 blocks"), "not_found", NOT_FOUND_MESSAGE, {}),
        (
            PrefixNotCached(32, 16),
            "prefix_not_cached",
            "tokens[:32] are not cached (the cache holds 16)",
            {"num_cached": 16},
        ),
        (KVNotStorable("NaN into int8"), "bad_request", "NaN into int8", {"reason": "kv_not_storable"}),
        (SsdWriterFailed("disk full at /srv/ssd/tenant-a"), "internal", "internal error", {}),
    ],
)
def test_an_answer_says_the_code_and_never_a_node_failures_text(error, code, message, details):
    answer = answer_error(error, sequence=2)
    assert (answer.code, answer.message, answer.details) == (code, message, {**details, "sequence": 2})
    assert isinstance(error, NodeError)
