"""Checks on model files before anything is allocated from them: the config, and the
checkpoint's tensors against it (their headers are read by :mod:`pagedserve.model.file_headers`,
whose names are re-exported here). Every problem is a one-line :class:`ModelFileError`.

The pieces, for any loader (HF folders, GGUF conversion; LoRA adapters and quantized
tensors later):

- :func:`check_config`: config.json fields with the right types and sane ranges
  (:func:`check_gguf_metadata`: the same for the GGUF metadata transformers makes a config of).
- :func:`check_weights`: each checkpoint tensor has a float dtype, and its name and shape are
  exactly what the config describes (the model's own ``load_weights`` runs on meta tensors, so
  the rule is the one the real load applies, with nothing allocated).
- :func:`validate_model_dir`: all of the above for an HF folder (remembered per file state).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Iterable, Mapping, Optional

from pagedserve.model.file_headers import *  # noqa: F403  (the readers and limits, re-exported)
from pagedserve.model.file_headers import (
    FLOAT_WEIGHT_DTYPES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_JSON_BYTES,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_ROPE_TABLE,
    MAX_VOCAB,
    SUPPORTED_MODEL_TYPES,
    GGUFHeader,
    ModelFileError,
    TensorSpec,
    _file_size,
    _is_int,
    describe,
    read_safetensors_header,
    short,
)
from pagedserve.model.moe_gguf import GGUF_ARCH_MODEL_TYPES

MAX_EXPERTS = 4096  # routed experts per MoE layer (Qwen3-MoE: 128, DeepSeek-V3: 256)

# -- config ---------------------------------------------------------------------------------------
# name: (lowest, highest); None means "not given" wherever transformers has a default.
_CONFIG_INTS = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_HIDDEN),
    "intermediate_size": (1, MAX_INTERMEDIATE),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS),
    "head_dim": (2, MAX_HEAD_DIM),
    "max_position_embeddings": (1, MAX_POSITIONS),
    "sliding_window": (0, MAX_POSITIONS),  # 0: none (what Qwen2-MoE writes without use_sliding_window)
    "max_window_layers": (0, MAX_LAYERS),
    "original_max_position_embeddings": (1, MAX_POSITIONS),  # phi3 LongRoPE
    # mixture of experts (moe.py): Mixtral's num_local_experts, Qwen's num_experts (0: all dense)
    "num_local_experts": (1, MAX_EXPERTS),
    "num_experts": (0, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "moe_intermediate_size": (1, MAX_INTERMEDIATE),
    "shared_expert_intermediate_size": (0, MAX_INTERMEDIATE),
    "decoder_sparse_step": (1, MAX_LAYERS),
}
_CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob", "qkv_bias")
_CONFIG_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Gemma 2/3 read ``hidden_activation`` (not ``hidden_act``): GeGLU with the tanh GELU only.
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
_GEMMA_POSITIVE = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq")


LAYER_TYPES = ("full_attention", "sliding_attention")  # registry.layer_windows reads these


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def read_json(path: str, what: str = "JSON file") -> Any:
    """A small JSON file (at most ``MAX_JSON_BYTES``), parsed."""
    size = _file_size(path)
    if size > MAX_JSON_BYTES:
        raise ModelFileError(path, f"{what} is {size} bytes, over the {MAX_JSON_BYTES} byte limit")
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read(MAX_JSON_BYTES + 1).decode("utf-8"))
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(path, f"{what} is not valid JSON ({describe(e)})") from None


def check_config(path: str, cfg: Mapping[str, Any]) -> None:
    """Types and ranges of the config fields pagedserve's model reads (``cfg``: config.json
    parsed, or a transformers config's ``to_dict()``); ``path`` names the file in errors.

    Raises:
        ModelFileError: a field of the wrong type or out of range, an unsupported model_type or
            activation, heads that do not divide, a quantized checkpoint.
    """
    if not isinstance(cfg, Mapping):
        raise ModelFileError(path, f"config is a JSON {type(cfg).__name__}, not an object")

    def bad(field: str, value: Any, want: str) -> ModelFileError:
        return ModelFileError(path, f"config field {field}={short(value)} {want}")

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise bad("model_type", model_type, "is not a string (supported: " + ", ".join(SUPPORTED_MODEL_TYPES) + ")")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise bad("model_type", model_type, "is not supported (supported: " + ", ".join(SUPPORTED_MODEL_TYPES) + ")")
    if cfg.get("quantization_config") is not None:
        q = cfg["quantization_config"]
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise bad("quantization_config", method, "is set: quantized checkpoints are not supported")
    for field, (lo, hi) in _CONFIG_INTS.items():
        v = cfg.get(field)
        if v is not None and (not _is_int(v) or not lo <= v <= hi):
            raise bad(field, v, f"is not an integer in [{lo}, {hi}]")
    for field in _CONFIG_BOOLS:
        v = cfg.get(field)
        if v is not None and not isinstance(v, bool):
            raise bad(field, v, "is not true or false")
    for field in _CONFIG_TOKEN_IDS:
        v = cfg.get(field)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) and -1 <= i < (1 << 31) for i in ids):  # -1: "none" in old configs
            raise bad(field, v, "is not a token id (or a list of them)")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1):
        raise bad("rms_norm_eps", eps, "is not a number in (0, 1)")
    if model_type in GEMMA_MODEL_TYPES:
        _check_gemma(path, cfg, bad)
    else:
        act = cfg.get("hidden_act")
        if act is not None and act not in SUPPORTED_ACTIVATIONS:
            raise bad("hidden_act", act, "is not supported (supported: " + ", ".join(SUPPORTED_ACTIVATIONS) + ")")
    rope = [cfg]
    for field in ("rope_parameters", "rope_scaling"):
        v = cfg.get(field)
        if v is not None and not isinstance(v, Mapping):
            raise bad(field, v, "is not an object")
        if v is not None:
            rope.append(v)
    for v in list(rope[1:]):  # Gemma 3: rope_parameters per layer type
        rope += [sub for sub in v.values() if isinstance(sub, Mapping)]
    for where in rope:
        theta = where.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < 1e15):
            raise bad("rope_theta", theta, "is not a positive number")
        prf = where.get("partial_rotary_factor")  # phi3: RoPE on the first head_dim * prf dims
        if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1):
            raise bad("partial_rotary_factor", prf, "is not a number in (0, 1]")
        for field in ("short_factor", "long_factor"):  # LongRoPE: each divides an inverse frequency
            f = where.get(field)
            if f is not None and not (isinstance(f, list) and all(_positive(x) for x in f)):
                raise bad(field, f, "is not a list of positive finite numbers")
        for field in ("attention_factor", "factor"):
            f = where.get(field)
            if f is not None and not _positive(f):
                raise bad(field, f, "is not a positive finite number")
    only = cfg.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(_is_int(i) and 0 <= i < MAX_LAYERS for i in only)):
        raise bad("mlp_only_layers", only, "is not a list of layer indices")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    top_k = cfg.get("num_experts_per_tok")
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe") and experts and top_k is not None and top_k > experts:
        raise bad("num_experts_per_tok", top_k, f"is more than the model's {experts} experts")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise bad("layer_types", layer_types, "is not a list of strings")
    unknown = sorted({t for t in layer_types or () if t not in LAYER_TYPES})
    if unknown:
        raise bad("layer_types", unknown, "names attention kinds pagedserve does not run (supported: " + ", ".join(LAYER_TYPES) + ")")
    # Cross-field rules (the defaults transformers fills in for absent fields are consistent).
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelFileError(path, f"config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden, head_dim = cfg.get("hidden_size"), cfg.get("head_dim")
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ModelFileError(path, f"config hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and head_dim is not given)")
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise bad("head_dim", head_dim, "is odd (RoPE needs an even head_dim)")
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and head_dim is not None and max_pos * head_dim > MAX_ROPE_TABLE:
        raise ModelFileError(
            path, f"config max_position_embeddings={max_pos} x head_dim={head_dim} is over {MAX_ROPE_TABLE} (the RoPE table would not fit in memory)"
        )


def _check_gemma(path: str, cfg: Mapping[str, Any], bad: Callable[[str, Any, str], ModelFileError]) -> None:
    """Gemma 2/3's own fields (:func:`check_config`); a multimodal ``gemma3`` config's
    ``text_config`` is checked as a ``gemma3_text`` config."""
    if cfg.get("model_type") == "gemma3":
        text = cfg.get("text_config")
        if text is not None and not isinstance(text, Mapping):
            raise bad("text_config", text, "is not an object")
        check_config(path, {**(text or {}), "model_type": "gemma3_text"})
        return
    act = cfg.get("hidden_activation")
    if act is not None and act not in GEMMA_ACTIVATIONS:
        raise bad("hidden_activation", act, "is not supported (supported: " + ", ".join(GEMMA_ACTIVATIONS) + ")")
    for field in _GEMMA_POSITIVE:
        v = cfg.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e15):
            raise bad(field, v, "is not a positive number")
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None and (not _is_int(pattern) or not 1 <= pattern <= MAX_LAYERS):
        raise bad("sliding_window_pattern", pattern, f"is not an integer in [1, {MAX_LAYERS}]")
    if cfg.get("use_bidirectional_attention"):
        raise bad("use_bidirectional_attention", True, "is set: bidirectional (embedding) Gemma models are not supported")


# GGUF metadata (after "<architecture>.") -> the config field transformers makes of it.
GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def check_gguf_metadata(header: GGUFHeader) -> None:
    """The model metadata of a GGUF file, checked as :func:`check_config` checks config.json,
    before transformers builds a config from it.

    Raises:
        ModelFileError: an unsupported architecture, or a field of the wrong type or range.
    """
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(header.path, f"GGUF general.architecture {short(arch)} is missing or not a string")
    model_type = GGUF_ARCH_MODEL_TYPES.get(arch, arch)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(header.path, f"GGUF architecture {short(arch)} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    fields: dict[str, Any] = {"model_type": model_type}
    for suffix, field in GGUF_CONFIG_KEYS.items():
        key = f"{arch}.{suffix}"
        if key in header.metadata:
            fields[field] = header.metadata[key]
            try:
                check_config(header.path, {"model_type": model_type, field: fields[field]})
            except ModelFileError as e:
                raise ModelFileError(header.path, f"GGUF metadata {key}: {e.what}") from None
    try:
        check_config(header.path, fields)
    except ModelFileError as e:
        raise ModelFileError(header.path, f"GGUF metadata: {e.what}") from None


# -- checkpoint vs config ---------------------------------------------------------------------------
_LAYER = re.compile(r"^(?:model\.|language_model\.model\.|model\.language_model\.)?layers\.(\d+)\.")  # the last two: gemma3
# (config_path, hf_config, tensors) -> None, raising ModelFileError: the model's own name and shape check.
ShapeCheck = Callable[[str, Any, Mapping[str, "TensorSpec"]], None]


def check_weights(config_path: str, hf_config, tensors: Mapping[str, TensorSpec], shape_check: Optional[ShapeCheck] = None) -> None:
    """Every tensor is a float weight and there are weights for exactly the config's layers;
    then ``shape_check`` (``pagedserve.model.llama.check_checkpoint``: the model built on torch's
    meta device, its own ``load_weights`` over meta tensors of these shapes) checks every name
    and shape against the config, where given. ``config_path`` names the config in errors.

    Raises:
        ModelFileError: naming the weight file (a wrong dtype, an unexpected name, a shape that
            differs from the config's) or the config (layer count, missing weights).
    """
    for spec in tensors.values():
        if spec.dtype not in FLOAT_WEIGHT_DTYPES:
            raise ModelFileError(
                spec.path, f"tensor {short(spec.name)} has dtype {spec.dtype}; weights must be one of " + ", ".join(FLOAT_WEIGHT_DTYPES)
            )
    layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    n_layers = len(layers) and max(layers) + 1
    if hf_config.num_hidden_layers != n_layers:
        raise ModelFileError(
            config_path, f"config num_hidden_layers={hf_config.num_hidden_layers} but the checkpoint has weights for {n_layers} layers"
        )
    # Dimensions the RoPE table (built on the CPU even under the meta device) needs bounded.
    check_config(config_path, {k: getattr(hf_config, k, None) for k in ("model_type", "hidden_size", "num_attention_heads", "head_dim")})
    if shape_check is not None:
        shape_check(config_path, hf_config, tensors)


# -- an HF folder -----------------------------------------------------------------------------------
_validated: dict[tuple, tuple] = {}


def _state(paths: Iterable[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((p, None, None))
    return tuple(out)


def validate_model_dir(model_dir: str, load_config: Optional[Callable[[str], Any]] = None, shape_check: Optional[ShapeCheck] = None) -> None:
    """Check an HF model folder's config.json and weight headers against each other before
    anything is allocated from them; remembered until one of those files changes. Without
    ``shape_check`` (a process without torch: a server front) the names and shapes against the
    config are left to the engine core, which checks them before loading.

    Args:
        load_config: ``model_dir -> transformers config`` (default: AutoConfig, local files only).
        shape_check: the model's name and shape check (see :func:`check_weights`), or None.

    Raises:
        ModelFileError: naming the file and what is wrong with it.
    """
    import glob

    cfg_path = os.path.join(model_dir, "config.json")
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    key = (os.path.abspath(model_dir), shape_check is not None)
    state = _state([cfg_path, *files])
    if _validated.get(key) == state:
        return
    check_config(cfg_path, read_json(cfg_path, "config.json"))
    if load_config is None:
        from transformers import AutoConfig

        def load_config(d: str):
            return AutoConfig.from_pretrained(d, local_files_only=True)

    try:
        hf_config = load_config(model_dir)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(cfg_path, f"transformers cannot read it ({describe(e)})") from None
    if not files:
        raise ModelFileError(model_dir, "no *.safetensors weight files in this folder")
    tensors: dict[str, TensorSpec] = {}
    for f in files:
        for name, spec in read_safetensors_header(f).items():
            if name in tensors:
                raise ModelFileError(f, f"tensor {short(name)} is also in {tensors[name].path}")
            tensors[name] = spec
    check_weights(cfg_path, hf_config, tensors, shape_check)
    if len(_validated) > 64:
        _validated.clear()
    _validated[key] = state
