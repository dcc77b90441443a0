"""LoRA adapters in the PEFT format, read for the model's fused projections.

A PEFT LoRA adapter is a folder with ``adapter_config.json`` and ``adapter_model.safetensors``;
its tensors ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` target HF's unfused modules (q/k/v/o_proj, gate/up/down_proj).
:func:`load_peft_adapter` reads one into :class:`LoRAAdapter`: per layer and fused projection of
:mod:`pagedserve.model.llama` (``qkv``, ``o``, ``gate_up``, ``down``) one ``(A, B)`` pair in
float32 with the scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per module with
``rank_pattern`` / ``alpha_pattern``) folded into B. For ``qkv`` A stacks the rank rows of q, k
and v (those present) and B is block-diagonal: q's rank columns feed only q's output rows, etc.;
``gate_up`` likewise. So ``B @ (A @ x)`` is the fused projection's delta.

Everything wrong with an adapter is a :class:`LoRAError` naming its folder and the problem, raised
before anything is returned (never a half-loaded adapter). :mod:`pagedserve.model.lora_slots`
stacks resident adapters for the batched delta.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Rank columns of each fused projection's stacked A / B, in units of max_rank (qkv: q, k and v).
PROJ_WIDTH = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
# HF module -> (its parent in a decoder layer, the fused projection, its part of it).
MODULES = {
    "q_proj": ("self_attn", "qkv", 0),
    "k_proj": ("self_attn", "qkv", 1),
    "v_proj": ("self_attn", "qkv", 2),
    "o_proj": ("self_attn", "o", 0),
    "gate_proj": ("mlp", "gate_up", 0),
    "up_proj": ("mlp", "gate_up", 1),
    "down_proj": ("mlp", "down", 0),
}
# Config fields of LoRA variants whose forward is not x + B A x (or that change other weights).
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of other modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "target_parameters": "target_parameters",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+))\.lora_(?P<ab>[AB])\.weight$")
_OTHER_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_[AB]\.weight$")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class LoRAError(ValueError):
    """An adapter pagedserve cannot serve: its message names the adapter's path and the problem."""


@dataclass(frozen=True)
class LoRAModelSpec:
    """The served model's shapes an adapter must fit: per layer q_size = heads * head_dim,
    kv_size = kv_heads * head_dim."""

    num_layers: int
    hidden_size: int
    q_size: int
    kv_size: int
    intermediate_size: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "LoRAModelSpec":
        """From an HF config (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the heads), ``head_dim`` (default hidden / heads),
        ``intermediate_size``)."""
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(int(cfg.num_hidden_layers), int(cfg.hidden_size), heads * head_dim, kv_heads * head_dim, int(cfg.intermediate_size))

    def module_shape(self, name: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of the HF module ``name`` (a key of :data:`MODULES`)."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }[name]

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of the fused projection ``proj`` (a key of :data:`PROJ_WIDTH`)."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}[proj]

    def row_offsets(self, proj: str) -> list[int]:
        """The first output row of each part of the fused projection (q, k, v / gate, up)."""
        return {"qkv": [0, self.q_size, self.q_size + self.kv_size], "gate_up": [0, self.intermediate_size]}.get(proj, [0])


@dataclass
class LoRAAdapter:
    """One adapter, read for the fused projections.

    ``weights[(layer, proj)] = (A, B)``: A float32 ``[r_total, in_features]``, B float32
    ``[out_features, r_total]`` of the fused projection (scaling folded in; block-diagonal over
    q/k/v or gate/up: zeros outside each module's rows and rank columns), for the layers and
    projections the adapter targets; ``r_total`` the sum of the ranks of its modules there.
    ``rank``: the largest rank of one module; ``target_modules``: the HF module names present.
    """

    path: str
    rank: int
    target_modules: frozenset[str]
    base_model_name: Optional[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        """Bytes of the float32 weights held."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"LoRA adapter {path}: no {CONFIG_FILE}")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _number(path: str, cfg: dict, key: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} {key} must be a positive number, got {v!r}")
    return float(v)


# rank_pattern / alpha_pattern keys: plain dotted module paths only (PEFT's escaped dot ``\.``
# allowed). PEFT treats a key as a regex; an adapter's regex is never run here (a catastrophic-
# backtracking key would hang the engine core, which loads adapters).
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
MAX_PATTERN_KEYS = 4096
MAX_PATTERN_KEY_LEN = 256
MAX_SCALING = 1e6  # |lora_alpha / r| (or / sqrt(r)) above this is refused


def _pattern(path: str, cfg: dict, key: str) -> dict[str, float]:
    """The config's ``key`` (rank_pattern / alpha_pattern): module path -> number, keys unescaped.

    Raises:
        LoRAError: not an object, too many or too long keys, a key that is not a plain dotted
            module path (regular expressions are refused), a value that is not a positive number.
    """
    v = cfg.get(key) or {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} {key} must be an object of module patterns, got {v!r}")
    if len(v) > MAX_PATTERN_KEYS:
        raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} {key} has {len(v)} keys, at most {MAX_PATTERN_KEYS} are accepted")
    out = {}
    for k in v:
        if len(k) > MAX_PATTERN_KEY_LEN:
            raise LoRAError(f"LoRA adapter {path}: {CONFIG_FILE} {key} has a key of {len(k)} characters, at most {MAX_PATTERN_KEY_LEN} are accepted")
        plain = k.replace("\\.", ".")
        if not all(part and set(part) <= _KEY_CHARS for part in plain.split(".")):
            raise LoRAError(
                f"LoRA adapter {path}: {CONFIG_FILE} {key} has the key {k!r}: regular expressions in rank_pattern/alpha_pattern "
                "are not supported; give module names (like 'q_proj' or 'layers.0.self_attn.q_proj')"
            )
        out[plain] = _number(path, v, k, 0)
    return out


def _match(patterns: dict[str, float], module: str) -> Optional[float]:
    """PEFT's get_pattern_key for plain keys: the first key equal to the module's dotted name or
    to a suffix of it starting after a dot (no regex is run)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return None


def _check_config(path: str, cfg: dict) -> None:
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {path}: peft_type is {peft_type!r}, only 'LORA' adapters are served")
    for key, what in _UNSUPPORTED_FIELDS.items():
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {path}: {what} is not supported")
    bias = cfg.get("bias", "none")
    if bias not in ("none", None):
        raise LoRAError(f"LoRA adapter {path}: bias={bias!r} is not supported (only 'none': biases of the base modules are not trained)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = sorted({str(t) for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in MODULES})
        if bad:
            raise LoRAError(f"LoRA adapter {path}: target modules {bad} are not LoRA targets of this model (only {', '.join(MODULES)})")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        if os.path.exists(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(
                f"LoRA adapter {path}: only {WEIGHTS_FILE} is read; adapter_model.bin is a pickle, never unpickled "
                "(convert it with PEFT's save_pretrained(..., safe_serialization=True))"
            )
        raise LoRAError(f"LoRA adapter {path}: no {WEIGHTS_FILE}")
    try:
        from safetensors.torch import load_file

        return load_file(weights_path)
    except Exception as e:  # the parser's own error types (SafetensorError, OSError, ...)
        raise LoRAError(f"LoRA adapter {path}: {WEIGHTS_FILE} does not parse as safetensors ({type(e).__name__}: {e})") from e


def load_peft_adapter(path: str, spec: LoRAModelSpec, max_rank: int) -> LoRAAdapter:
    """Read the PEFT LoRA adapter in the folder ``path`` for a model of shapes ``spec``.

    Returns:
        The adapter (float32 weights on the CPU), whole; ``base_model_name`` is the config's
        ``base_model_name_or_path`` (a different name from the served model's is not an error).

    Raises:
        LoRAError: a missing folder, config or weights file (``adapter_model.bin`` alone is
            refused: never unpickled); malformed JSON or safetensors; ``peft_type`` not ``LORA``;
            a LoRA variant (DoRA, modules_to_save, lora_bias, bias other than "none", ...); a
            target module this model does not have (only q/k/v/o_proj and gate/up/down_proj); a
            module rank above ``max_rank`` or different from the config's ``r`` / ``rank_pattern``;
            a tensor of the wrong shape for the model, a layer out of range, a lora_A without its
            lora_B (or the reverse), NaN or infinite weights (also after the scaling is folded
            into B), a scaling above ``MAX_SCALING``, no LoRA weights at all; a
            ``rank_pattern`` / ``alpha_pattern`` key that is not a plain module path (regular
            expressions are never run), longer than 256 characters, or more than 4096 keys.
    """
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {path}: no such folder")
    cfg = _read_config(path)
    _check_config(path, cfg)
    r_default = _number(path, cfg, "r", 8)
    alpha_default = _number(path, cfg, "lora_alpha", 8)
    rank_pattern, alpha_pattern = _pattern(path, cfg, "rank_pattern"), _pattern(path, cfg, "alpha_pattern")
    rslora = bool(cfg.get("use_rslora", False))
    base = cfg.get("base_model_name_or_path")
    tensors = _read_tensors(path)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            other = _OTHER_KEY.match(key)
            if other is not None:
                raise LoRAError(
                    f"LoRA adapter {path}: tensor {key!r} targets {other['module']}, not a LoRA target of this model (only {', '.join(MODULES)})"
                )
            what = "DoRA magnitudes" if "lora_magnitude_vector" in key else "embedding LoRA" if "lora_embedding" in key else "not a LoRA weight"
            raise LoRAError(f"LoRA adapter {path}: tensor {key!r} is not supported ({what}; only lora_A / lora_B of {', '.join(MODULES)})")
        name, layer = m["name"], int(m["layer"])
        if name not in MODULES or MODULES[name][0] != m["parent"]:
            raise LoRAError(
                f"LoRA adapter {path}: tensor {key!r} targets {m['parent']}.{name}, which this model has no LoRA target for (only {', '.join(MODULES)})"
            )
        if layer >= spec.num_layers:
            raise LoRAError(f"LoRA adapter {path}: tensor {key!r} is for layer {layer}, the model has {spec.num_layers} layers")
        pairs.setdefault((layer, name), {})[m["ab"]] = t
        names[(layer, name)] = m["module"]
    if not pairs:
        raise LoRAError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}  # (A, scaled B, rank)
    for (layer, name), ab in sorted(pairs.items()):
        where = f"layer {layer} {name}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path}: {where} has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        out_f, in_f = spec.module_shape(name)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise LoRAError(
                f"LoRA adapter {path}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model "
                f"(expected [r, {in_f}] and [{out_f}, r]: an adapter for another base model?)"
            )
        if a.dtype not in _FLOAT_DTYPES or b.dtype not in _FLOAT_DTYPES:
            raise LoRAError(f"LoRA adapter {path}: {where}: weights of dtype {a.dtype} / {b.dtype}, expected floating point")
        r = a.shape[0]
        want_r = _match(rank_pattern, names[(layer, name)])
        want_r = r_default if want_r is None else want_r
        if r != want_r:
            raise LoRAError(f"LoRA adapter {path}: {where} has rank {r} in its weights but {want_r:g} in {CONFIG_FILE} (r / rank_pattern)")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {path}: {where} has rank {r}, above the maximum LoRA rank {max_rank} (--max-lora-rank)")
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise LoRAError(f"LoRA adapter {path}: {where} has NaN or infinite weights")
        alpha = _match(alpha_pattern, names[(layer, name)])
        alpha = alpha_default if alpha is None else alpha
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        if not math.isfinite(scaling) or abs(scaling) > MAX_SCALING:
            raise LoRAError(
                f"LoRA adapter {path}: {where} has scaling {scaling:g} (lora_alpha / alpha_pattern {alpha:g} over "
                f"{'sqrt(r)' if rslora else 'r'}), above the accepted {MAX_SCALING:g}"
            )
        b_scaled = b32 * scaling
        if not torch.isfinite(b_scaled).all():
            raise LoRAError(f"LoRA adapter {path}: {where}: lora_B times the scaling {scaling:g} overflows float32 (NaN or infinite weights)")
        modules[(layer, name)] = (a32.contiguous(), b_scaled, r)

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(spec.num_layers):
        for proj in PROJ_WIDTH:
            parts = [(MODULES[n][2], n) for n in MODULES if MODULES[n][1] == proj and (layer, n) in modules]
            if not parts:
                continue
            out_f, in_f = spec.proj_shape(proj)
            offsets = spec.row_offsets(proj)
            r_total = sum(modules[(layer, n)][2] for _, n in parts)
            a_fused = torch.cat([modules[(layer, n)][0] for _, n in sorted(parts)])
            b_fused = torch.zeros(out_f, r_total)
            col = 0
            for part, n in sorted(parts):
                _, b, r = modules[(layer, n)]
                b_fused[offsets[part] : offsets[part] + b.shape[0], col : col + r] = b
                col += r
            weights[(layer, proj)] = (a_fused, b_fused)
    return LoRAAdapter(
        path=path,
        rank=max(r for _, _, r in modules.values()),
        target_modules=frozenset(n for _, n in modules),
        base_model_name=base if isinstance(base, str) else None,
        weights=weights,
    )
