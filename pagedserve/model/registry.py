"""Which model class serves a checkpoint (by its config's ``model_type``) and the per-layer facts
every family shares with the engine: each layer's attention window.

Families live in their own files (``llama.py``, ``gemma.py``, ``phi3.py``, ``moe.py``) and are
imported only when asked for. Every class has the same surface: ``__init__(config,
max_positions, tp=None)``, ``forward(input_ids, positions, kv_caches, attn_metadata, lora=None)``,
``compute_logits``, ``pack_for_cpu``, ``load_weights``, the classmethod ``module_of``, and the
attributes ``config``, ``layers`` (each with ``self_attn``), ``rotary_emb``, ``tp``, ``backend``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Iterable, Mapping, Optional

import torch

from pagedserve.model.file_headers import SUPPORTED_MODEL_TYPES, ModelFileError, TensorSpec, describe

# model_type -> (module, class)
_CLASSES = {
    "llama": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "mistral": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "qwen2": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "qwen3": ("pagedserve.model.llama", "LlamaForCausalLM"),
    "phi3": ("pagedserve.model.phi3", "Phi3ForCausalLM"),
    "mixtral": ("pagedserve.model.moe", "MoeForCausalLM"),
    "qwen2_moe": ("pagedserve.model.moe", "MoeForCausalLM"),
    "qwen3_moe": ("pagedserve.model.moe", "MoeForCausalLM"),
    "gemma2": ("pagedserve.model.gemma", "GemmaForCausalLM"),
    "gemma3_text": ("pagedserve.model.gemma", "GemmaForCausalLM"),
}


def model_class(model_type: str) -> Any:
    """The class that serves ``model_type``.

    Raises:
        ValueError: an unsupported model_type.
    """
    if model_type not in _CLASSES or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    module, name = _CLASSES[model_type]
    return getattr(import_module(module), name)


def layer_windows(hf_config) -> list[Optional[int]]:
    """Each layer's attention window in tokens (None: full attention). A query at position p
    reads keys at positions k with ``p - window < k <= p`` (HF transformers'
    ``sliding_window_overlay``). Read from ``layer_types`` where the config has it (Gemma 2/3,
    Qwen2 with ``use_sliding_window`` from ``max_window_layers`` on), else Mistral v0.1's
    ``sliding_window`` on every layer."""
    n = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return [None] * n
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if hf_config.model_type in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
        return [None] * n
    return [int(window)] * n


def sliding_window(hf_config) -> Optional[int]:
    """The window when every layer uses the same one (pure sliding-window attention, whose
    blocks can be freed as decoding moves on), else None."""
    windows = set(layer_windows(hf_config))
    return windows.pop() if len(windows) == 1 else None


def check_checkpoint(config_path: str, hf_config, tensors: Mapping[str, TensorSpec]) -> None:
    """Names and shapes of a checkpoint's tensors against ``hf_config``: the model is built on
    the meta device (nothing allocated) and its own ``load_weights`` runs over meta tensors of
    the checkpoint's shapes (``pagedserve.model.validation.check_weights`` calls this).

    Raises:
        ModelFileError: naming the weight file (an unexpected name, a shape that differs from the
            config's) or the config (one the model cannot be built from, missing weights).
    """
    try:
        with torch.device("meta"):
            model = model_class(hf_config.model_type)(hf_config, 1)
    except Exception as e:  # the config's values (already range-checked) that the model cannot take
        raise ModelFileError(config_path, f"the model cannot be built from this config ({describe(e)})") from None
    current: list[TensorSpec] = []

    def meta_weights() -> Iterable[tuple[str, torch.Tensor]]:
        for spec in tensors.values():
            current[:] = [spec]
            yield spec.name, torch.empty(spec.shape, dtype=torch.float32, device="meta")
        current.clear()

    try:
        model.load_weights(meta_weights())
    except ValueError as e:
        where = current[0].path if current else config_path
        raise ModelFileError(where, f"{e} (config: {config_path})" if where != config_path else str(e)) from None
