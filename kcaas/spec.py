"""The identity and layout of an attached KV cache (torch-free: the SDK, the node and the control plane share it).

A cache holds KV for exactly one model layout. Every request that carries KV (or asks for it) is checked against this
identity field by field, because a silently mismatched layout (another head count, another block size, another dtype,
another model revision with the same shapes) produces plausible-looking but wrong attention — the most common bug
class in KV-cache stores. A mismatch is refused with `IdentityMismatch`, naming each differing field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KV_DTYPES = ("float32", "float16", "bfloat16")
STORAGE_DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3")
QUANTIZED_STORAGE_DTYPES = ("int8", "fp8_e4m3")
DTYPE_NUM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}
SCALE_NUM_BYTES = 4  # one float32 scale per (token, layer, K/V, kv head) for quantized storage
MAX_BLOCK_SIZE = 1024
MAX_FINGERPRINT_LEN = 256
DEFAULT_BLOCK_SIZE = 16  # tokens per block unless the engine says otherwise
ATTENTION_KINDS = ("mha", "mla")  # per-head K and V (MHA, GQA, MQA); one latent row per token (MLA)


class SpecError(ValueError):
    """An identity/layout that is invalid on its own (e.g. head_dim 0, unknown dtype)."""

    code = "invalid_spec"


class IdentityMismatch(ValueError):
    """A request's identity differs from the cache's; `fields` maps each field to (cache value, request value)."""

    code = "identity_mismatch"

    def __init__(self, fields: dict[str, tuple[Any, Any]]):
        self.fields = fields
        detail = ", ".join(f"{name}: cache has {have!r}, request has {got!r}" for name, (have, got) in fields.items())
        super().__init__(f"KV identity mismatch ({detail})")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a cache stores: one model's KV, in one layout.

    Two attention kinds (docs/ARCHITECTURE.md, "Latent KV"):
    - "mha": per-head K and V (MHA, GQA, MQA); `kv_lora_rank` and `qk_rope_head_dim` are 0.
    - "mla": multi-head latent attention (DeepSeek-V2/V3 and kin): one latent row per token per layer,
      `[kv_c_normed (kv_lora_rank) | k_pe (qk_rope_head_dim)]`, post-norm and post-RoPE, identical on every
      tensor-parallel rank. The pool keeps the row as the two halves of one "head" (num_kv_heads 1, head_dim
      latent_dim / 2): the K plane holds the row's first half, the V plane its second, so bytes per token are
      exactly num_layers * latent_dim * dtype bytes. `kcaas.latent` converts rows to that form and back.
    """

    model_fingerprint: str  # model name + revision (or a weights digest): same shapes, other model => other cache
    num_layers: int  # attention layers whose KV is stored
    num_kv_heads: int  # KV heads per layer (GQA: fewer than query heads)
    head_dim: int  # elements per head
    block_size: int  # tokens per block: the unit of hashing, sharing and eviction
    kv_dtype: str  # the engine's KV dtype, what put takes and get returns
    storage_dtype: str  # what the pool holds: kv_dtype as-is, a wider/narrower float, or int8/fp8 with scales
    attention: str = "mha"  # one of ATTENTION_KINDS
    kv_lora_rank: int = 0  # mla: width of the compressed KV (kv_c_normed); 0 for mha
    qk_rope_head_dim: int = 0  # mla: width of the shared rotary key (k_pe); 0 for mha

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise SpecError("invalid KV cache spec: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if not isinstance(self.model_fingerprint, str) or not 0 < len(self.model_fingerprint) <= MAX_FINGERPRINT_LEN:
            problems.append(f"model_fingerprint must be a non-empty string of at most {MAX_FINGERPRINT_LEN} chars")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.block_size, int) and self.block_size > MAX_BLOCK_SIZE:
            problems.append(f"block_size must be at most {MAX_BLOCK_SIZE}")
        if self.kv_dtype not in KV_DTYPES:
            problems.append(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.storage_dtype not in STORAGE_DTYPES:
            problems.append(f"storage_dtype must be one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        return problems + self._attention_problems()

    def _attention_problems(self) -> list[str]:
        if self.attention not in ATTENTION_KINDS:
            return [f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}"]
        widths = (self.kv_lora_rank, self.qk_rope_head_dim)
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in widths):
            return [f"kv_lora_rank and qk_rope_head_dim must be non-negative integers, got {widths!r}"]
        if self.attention == "mha":
            return [] if widths == (0, 0) else ["kv_lora_rank and qk_rope_head_dim are 0 unless attention is 'mla'"]
        if self.kv_lora_rank < 1:
            return ["an 'mla' spec needs kv_lora_rank >= 1"]
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if latent % 2:
            return [f"an 'mla' latent row (kv_lora_rank + qk_rope_head_dim = {latent}) must have an even width"]
        if (self.num_kv_heads, self.head_dim) != latent_head_shape(self.kv_lora_rank, self.qk_rope_head_dim):
            return [
                f"an 'mla' spec stores its {latent}-wide latent row as num_kv_heads 1 and head_dim {latent // 2}, "
                f"got {self.num_kv_heads} and {self.head_dim} (KVCacheSpec.latent builds it)"
            ]
        return []

    @classmethod
    def latent(
        cls,
        *,
        model_fingerprint: str,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_dtype: str = "bfloat16",
        storage_dtype: str | None = None,
    ) -> KVCacheSpec:
        """The spec of an MLA model's latent KV (num_kv_heads and head_dim follow from the latent width).

        Raises: SpecError when a value is invalid (an odd latent width among them)."""
        num_kv_heads, head_dim = latent_head_shape(kv_lora_rank, qk_rope_head_dim)
        return cls(
            model_fingerprint=model_fingerprint,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            kv_dtype=kv_dtype,
            storage_dtype=storage_dtype or kv_dtype,
            attention="mla",
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )

    @property
    def latent_dim(self) -> int:
        """Width of one latent row (kv_lora_rank + qk_rope_head_dim); 0 for an 'mha' spec."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_quantized(self) -> bool:
        return self.storage_dtype in QUANTIZED_STORAGE_DTYPES

    @property
    def elements_per_token(self) -> int:
        """K and V elements of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV in the engine's dtype (what crosses the API)."""
        return self.elements_per_token * DTYPE_NUM_BYTES[self.kv_dtype]

    @property
    def storage_bytes_per_token(self) -> int:
        """Bytes one token occupies in the pool, scales included."""
        scale_bytes = 2 * self.num_layers * self.num_kv_heads * SCALE_NUM_BYTES if self.is_quantized else 0
        return self.elements_per_token * DTYPE_NUM_BYTES[self.storage_dtype] + scale_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.storage_bytes_per_token

    def mismatches(self, other: KVCacheSpec) -> dict[str, tuple[Any, Any]]:
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }

    def check_matches(self, other: KVCacheSpec) -> None:
        """Raise IdentityMismatch unless `other` is exactly this identity."""
        if other is self or other == self:
            return
        fields = self.mismatches(other)
        if fields:
            raise IdentityMismatch(fields)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELD_NAMES}  # every field is a str or an int: no deep copy

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheSpec:
        """The spec a dict names; the attention fields may be absent (senders that predate them mean 'mha').

        Raises: SpecError naming unknown and missing fields, or what is invalid."""
        names = set(_FIELD_NAMES)
        unknown = set(data) - names
        missing = names - set(data) - set(_ATTENTION_FIELDS)
        if unknown or missing:
            raise SpecError(
                f"invalid KV cache spec: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
            )
        return cls(**data)

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        dtype: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        model_fingerprint: str | None = None,
        storage_dtype: str | None = None,
        mtp_layers: bool = False,
    ) -> KVCacheSpec:
        """The identity of a transformers model's KV from its config (a PretrainedConfig or its dict).

        num_layers from num_hidden_layers (plus num_nextn_predict_layers, the multi-token-prediction layers, when
        `mtp_layers`); kv_dtype `dtype` or the config's dtype/torch_dtype (float32 when neither says);
        storage_dtype kv_dtype unless given; the fingerprint `<name_or_path>@<revision or main>` unless given.
        A config with a kv_lora_rank (DeepSeek-V2/V3 and kin) gives an 'mla' spec of its latent rows; any other
        num_kv_heads from num_key_value_heads (num_attention_heads without GQA) and head_dim the config's own
        `head_dim` when it has one (Gemma, Qwen3: not hidden_size // heads), else hidden_size //
        num_attention_heads.

        Raises: SpecError naming what the config lacks."""
        values = _hf_values(config)
        kv_dtype = dtype or _hf_dtype(values)
        fingerprint = model_fingerprint or _hf_fingerprint(values)
        layers = _hf_int(values, "num_hidden_layers") + (_hf_mtp_layers(values) if mtp_layers else 0)
        storage = storage_dtype or kv_dtype
        if values.get("kv_lora_rank") is not None:
            rope = values.get("qk_rope_head_dim")
            if isinstance(rope, bool) or not isinstance(rope, int) or rope < 0:
                raise SpecError(f"invalid KV cache spec: the MLA config has no qk_rope_head_dim (got {rope!r})")
            return cls.latent(
                model_fingerprint=fingerprint,
                num_layers=layers,
                kv_lora_rank=_hf_int(values, "kv_lora_rank"),
                qk_rope_head_dim=rope,
                block_size=block_size,
                kv_dtype=kv_dtype,
                storage_dtype=storage,
            )
        heads = _hf_int(values, "num_attention_heads")
        head_dim = values.get("head_dim") or _hf_int(values, "hidden_size") // heads
        return cls(
            fingerprint, layers, values.get("num_key_value_heads") or heads, head_dim, block_size, kv_dtype, storage
        )


def latent_head_shape(kv_lora_rank: Any, qk_rope_head_dim: Any) -> tuple[int, int]:
    """(num_kv_heads, head_dim) an 'mla' spec stores its rows as: one head of half the latent width.

    Widths that are not integers give (1, 1), so the spec's own validation names them."""
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in (kv_lora_rank, qk_rope_head_dim)):
        return 1, 1
    return 1, max((kv_lora_rank + qk_rope_head_dim) // 2, 1)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(KVCacheSpec))
_ATTENTION_FIELDS = ("attention", "kv_lora_rank", "qk_rope_head_dim")


def _hf_values(config: Any) -> dict[str, Any]:
    """The fields of a transformers config (text_config for multimodal ones), or the dict as given."""
    values = dict(config) if isinstance(config, dict) else dict(config.to_dict())
    text = values.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in values:
        values = {**values, **text}
    if not isinstance(config, dict):
        values.setdefault("_name_or_path", getattr(config, "name_or_path", "") or "")
        values.setdefault("_commit_hash", getattr(config, "_commit_hash", None))
    return values


def _hf_int(values: dict[str, Any], name: str) -> int:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"invalid KV cache spec: the model config has no positive integer {name} (got {value!r})")
    return value


def _hf_mtp_layers(values: dict[str, Any]) -> int:
    value = values.get("num_nextn_predict_layers") or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"invalid KV cache spec: num_nextn_predict_layers must be an integer >= 0, got {value!r}")
    return value


def _hf_dtype(values: dict[str, Any]) -> str:
    raw = values.get("dtype") or values.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise SpecError(f"invalid KV cache spec: the model's dtype {name!r} is not one of {KV_DTYPES}; pass dtype=")
    return name


def _hf_fingerprint(values: dict[str, Any]) -> str:
    name = values.get("_name_or_path") or values.get("name_or_path") or ""
    if not name:
        raise SpecError("invalid KV cache spec: the model config has no name_or_path; pass model_fingerprint=")
    return f"{name}@{values.get('_commit_hash') or values.get('revision') or 'main'}"
