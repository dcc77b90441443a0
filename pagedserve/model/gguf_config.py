"""Config fields that transformers' GGUF reader leaves at their defaults but llama.cpp's
converter writes (or fixes by convention), per architecture; torch-free.

Gemma 2/3 (llama.cpp ``conversion/gemma.py`` and ``src/llama-model.cpp``):

- ``{arch}.attn_logit_softcapping`` / ``{arch}.final_logit_softcapping``: the softcaps
  (absent: Gemma 2's defaults 50 / 30; Gemma 3 has no attention cap, and no final cap unless
  written);
- ``{arch}.rope.scaling.type`` / ``.factor``: the global layers' linear RoPE scaling (Gemma 3
  4B and up), ``{arch}.rope.freq_base_swa``: the local layers' base (else 10,000);
- ``query_pre_attn_scalar`` is not stored: llama.cpp scales by ``head_dim ** -0.5``, except for the
  27B models (46 layers for Gemma 2, 62 for Gemma 3), which use ``(hidden / heads) ** -0.5``;
- the local/global layer pattern is not stored either: Gemma 2 alternates (even layers local),
  Gemma 3 has five local layers then one global, as transformers' defaults do.
"""

from __future__ import annotations

from typing import Any

from pagedserve.model.file_headers import GGUFHeader, ModelFileError, short

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _number(header: GGUFHeader, key: str) -> Any:
    v = header.metadata.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e15):
        raise ModelFileError(header.path, f"GGUF metadata {key}={short(v)} is not a positive number")
    return v


def fix_gguf_config(config: Any, header: GGUFHeader) -> None:
    """Set on ``config`` (the transformers config read from ``header``'s file) what the
    metadata says and transformers did not read. Nothing for architectures other than Gemma's.

    Raises:
        ModelFileError: a Gemma metadata field of the wrong type, or a RoPE scaling other than
            linear.
    """
    arch = header.metadata.get("general.architecture")
    if arch not in _GEMMA_27B_LAYERS:
        return
    heads, hidden = config.num_attention_heads, config.hidden_size
    config.query_pre_attn_scalar = hidden // heads if config.num_hidden_layers == _GEMMA_27B_LAYERS[arch] else config.head_dim
    final = _number(header, f"{arch}.final_logit_softcapping")
    if arch == "gemma2":
        attn = _number(header, f"{arch}.attn_logit_softcapping")
        if attn is not None:
            config.attn_logit_softcapping = float(attn)
        if final is not None:
            config.final_logit_softcapping = float(final)
        return
    config.final_logit_softcapping = None if final is None else float(final)
    if f"{arch}.attention.sliding_window" not in header.metadata:  # written unless every layer is global
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    local = _number(header, f"{arch}.rope.freq_base_swa")
    if local is not None:
        config.rope_parameters["sliding_attention"]["rope_theta"] = float(local)
    kind = header.metadata.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = _number(header, f"{arch}.rope.scaling.factor")
        if kind != "linear" or factor is None:
            raise ModelFileError(header.path, f"GGUF metadata {arch}.rope.scaling.type={short(kind)}: only linear scaling with a factor is supported")
        config.rope_parameters["full_attention"].update(rope_type="linear", factor=float(factor))
