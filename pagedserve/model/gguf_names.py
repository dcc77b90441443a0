"""llama.cpp's GGUF tensor names and layouts -> HF transformers' (torch-free): the name tables per
architecture (llama, phi3, gemma2/3, the MoE experts), which tensors are config rather than
weights, the Q/K row permutation llama.cpp's converter applies to llama files and the ``1 + w``
it stores for Gemma's norms. :mod:`pagedserve.model.files` converts a GGUF file's config with
these; :mod:`pagedserve.model.gguf_quant` reads its weights with them.
"""

from __future__ import annotations

from typing import Any, Iterator

from pagedserve.model.validation import GGUFHeader, ModelFileError, short

# llama.cpp's tensor names -> HF names (llama architecture).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (moe.py): the router, 3-D expert stacks [E, out, in], Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Model types of llama.cpp files whose Q/K rows its converter permuted: arch llama, which
# transformers names "mistral" when general.name says Mistral, "mixtral" with experts.
GGUF_PERMUTED_ARCHS = ("llama", "mistral", "mixtral")


# Where an architecture's names differ from llama's (phi3: fused Q/K/V, and gate+up in ffn_up;
# gemma2/gemma3: four norms per layer, ``ffn_norm`` being the one before the MLP).
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_ARCH_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "gemma3_text": _GEMMA_NAMES,  # the config's model_type for a gemma3 GGUF
}
# Tensors that are config, not weights: phi3's LongRoPE factors (read into config.json at conversion).
GGUF_CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
_GEMMA_ARCHS = ("gemma2", "gemma3", "gemma3_text")


def _gguf_hf_name(name: str, arch: str = "llama") -> str:
    """The HF name of a llama.cpp tensor name of architecture ``arch`` (or the config's
    model_type). Raises KeyError for a name with no HF twin."""
    stem, _, suffix = name.rpartition(".")  # suffix: weight / bias
    if suffix not in ("weight", "bias"):
        raise KeyError(name)
    names = {**_GGUF_NAMES, **_GGUF_ARCH_NAMES[arch]} if arch in _GGUF_ARCH_NAMES else _GGUF_NAMES
    if stem.startswith("blk."):
        _, idx, part = (stem.split(".", 2) + ["", ""])[:3]
        if not idx.isdigit() or not idx.isascii():
            raise KeyError(name)
        return f"model.layers.{int(idx)}.{names[part]}.{suffix}"
    return f"{names[stem]}.{suffix}"


def gguf_norm_shift(arch: str, hf_name: str) -> float:
    """What llama.cpp's converter added to a tensor: Gemma's RMSNorm scales are stored as
    ``1 + w`` (its ``(1 + weight)`` folded in), so the loader subtracts 1 (exact in float32:
    ``1 + ((1 + w) - 1)`` is again the stored value)."""
    return 1.0 if arch in _GEMMA_ARCHS and hf_name.endswith("norm.weight") else 0.0


def _gguf_weight_names(header: GGUFHeader) -> dict[str, str]:
    """GGUF name -> HF name for every tensor of a checked GGUF header.

    Raises:
        ModelFileError: a tensor with no HF name, or of a type outside SUPPORTED_GGUF_TYPES.
    """
    from pagedserve.model.file_headers import SUPPORTED_GGUF_TYPES

    names: dict[str, str] = {}
    arch = str(header.metadata.get("general.architecture"))
    for name, spec in header.tensors.items():
        if name in GGUF_CONFIG_TENSORS.get(arch, ()):
            continue
        try:
            names[name] = _gguf_hf_name(name, arch)
        except KeyError:
            raise ModelFileError(header.path, f"tensor {short(name)} is not a llama-family weight pagedserve knows") from None
        if spec.dtype not in SUPPORTED_GGUF_TYPES:
            raise ModelFileError(
                header.path, f"tensor {short(name)} has ggml type {spec.dtype}; pagedserve loads only {', '.join(SUPPORTED_GGUF_TYPES)}"
            )
    if len(set(names.values())) != len(names):
        raise ModelFileError(header.path, "two tensors map to the same HF weight name")
    return names


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved -> NeoX halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iterate_gguf_arrays(path: str, num_heads: int, num_kv_heads: int, arch: str) -> Iterator[tuple[str, Any]]:
    """Dequantized float32 numpy arrays of a GGUF file, with HF names and layouts (C order)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        if t.name in GGUF_CONFIG_TENSORS.get(arch, ()):
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = _gguf_hf_name(t.name, arch)
        shift = gguf_norm_shift(arch, name)
        if shift:
            arr = arr - np.float32(shift)
        if arch in GGUF_PERMUTED_ARCHS:
            if name.endswith("q_proj.weight"):
                arr = _unpermute_rope(arr, num_heads)
            elif name.endswith("k_proj.weight"):
                arr = _unpermute_rope(arr, num_kv_heads)
        yield name, np.array(arr, dtype=np.float32, order="C", copy=True)  # writable copy
