"""A stand-in for SGLang's host KV pool (run in .venv-sglang by tests/e2e/sglang_runner.py), because the real classes
cannot be imported here: sglang.srt.mem_cache.pool_host imports torchvision's operators, and no torchvision build
matches the CPU torch of locks/sglang.txt.

What is SGLang's own: `get_page_buffer_meta` (and MLA's `_storage_page_index`), the zero-copy API the backend uses,
are the installed sglang's functions, compiled from its source (pool_host/mha.py, pool_host/mla.py) and bound to
this class. What is the stand-in's: the attributes those functions and the backend read (layer_num, head_num,
head_dim, kv_lora_rank, qk_rope_head_dim, kv_cache_dim, dtype, page_size, size, layout, kv_buffer, dcp_size,
logical_page_size), the kv_buffer shapes of pool_host's init_kv_buffer for each layout (copied), and `page_bytes`,
which reads a page by slicing kv_buffer by token slot (independent of the backend's pointer arithmetic).
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import sglang
import torch

POOL_HOST = Path(sglang.__file__).parent / "srt" / "mem_cache" / "pool_host"


def sglang_method(module: str, class_name: str, name: str):
    """The function `class_name.name` of pool_host/<module>.py, compiled alone from the installed source."""
    path = POOL_HOST / f"{module}.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


class StandInHostPool:
    """An MHA (per-head K and V) or MLA (one latent row) host pool of `size` token slots in `layout`."""

    def __init__(self, *, kind, layout, layer_num, page_size, size, dtype, head_num=1, head_dim=0, kv_lora_rank=0,
                 qk_rope_head_dim=0):  # fmt: skip
        self.kind, self.layout, self.layer_num, self.page_size, self.size = kind, layout, layer_num, page_size, size
        self.dtype = getattr(torch, dtype)
        self.head_num, self.head_dim = head_num, head_dim
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.page_num = size // page_size
        self.dcp_size, self.logical_page_size = 1, page_size
        self.kv_buffer = torch.zeros(self._dims(), dtype=self.dtype)
        owner = ("mha", "MHATokenToKVPoolHost") if kind == "mha" else ("mla", "MLATokenToKVPoolHost")
        self._meta = sglang_method(*owner, "get_page_buffer_meta")
        if kind == "mla":
            self._storage_page_index = sglang_method("mla", "MLATokenToKVPoolHost", "_storage_page_index").__get__(self)

    def get_page_buffer_meta(self, indices):
        return self._meta(self, indices)

    def _dims(self) -> tuple[int, ...]:
        """kv_buffer's shape, as pool_host's init_kv_buffer makes it for this kind and layout."""
        L, S, P, N = self.layer_num, self.size, self.page_size, self.page_num
        if self.kind == "mha":
            H, D = self.head_num, self.head_dim
            return {
                "layer_first": (2, L, S, H, D),
                "page_first": (2, S, L, H, D),
                "page_first_direct": (2, N, L, P, H, D),
            }[self.layout]
        R = self.kv_cache_dim
        return {"layer_first": (L, S, 1, R), "page_first": (S, L, 1, R), "page_first_direct": (N, L, P, 1, R)}[
            self.layout
        ]

    def page_slots(self, page: int) -> torch.Tensor:
        """The host indices (token slots) of page `page`."""
        return torch.arange(page * self.page_size, (page + 1) * self.page_size, dtype=torch.int64)

    def page_bytes(self, page: int) -> bytes:
        """Every value of page `page` (all layers, K and V or the latent row), read by slot from kv_buffer."""
        a, b = page * self.page_size, (page + 1) * self.page_size
        kv = self.kv_buffer if self.kind == "mha" else self.kv_buffer.unsqueeze(0)  # MLA: no K/V axis
        if self.layout == "layer_first":
            part = kv[:, :, a:b]
        elif self.layout == "page_first":
            part = kv[:, a:b]
        else:
            part = kv[:, page]
        return part.contiguous().view(torch.uint8).numpy().tobytes()

    def page_digest(self, page: int) -> str:
        return hashlib.sha256(self.page_bytes(page)).hexdigest()

    def flat_page(self, page: int) -> torch.Tensor:
        """A copy of page `page`'s values, flat (the shape of SGLang's get_data_page(flat=True))."""
        return torch.frombuffer(bytearray(self.page_bytes(page)), dtype=self.dtype)
