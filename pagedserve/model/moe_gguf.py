"""What llama.cpp's GGUF metadata says about a mixture-of-experts model that transformers' GGUF
reader leaves out (torch-free: used while a GGUF file is converted to a config folder).

llama.cpp's converter (``conversion/qwen.py``, ``conversion/llama.py``) writes Qwen2/3-MoE as
architectures ``qwen2moe`` / ``qwen3moe`` with ``expert_feed_forward_length`` (the expert width)
and ``expert_shared_feed_forward_length`` (Qwen2-MoE's shared expert), and Mixtral as
architecture ``llama`` with ``llama.expert_count`` / ``llama.expert_used_count``. transformers
(5.25) maps the expert counts but not the widths, and reads a Mixtral file as a dense Llama.
"""

from __future__ import annotations

from typing import Any, Mapping

from pagedserve.model.file_headers import ModelFileError

# llama.cpp architecture -> HF model_type, where the two differ
GGUF_ARCH_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def moe_config_from_gguf(metadata: Mapping[str, Any], config, path: str = "<gguf>"):
    """``config`` (transformers' reading of the file) completed from the MoE metadata: the
    expert widths for ``qwen2moe`` / ``qwen3moe``; a ``MixtralConfig`` for a ``llama`` file with
    experts. Other files: ``config`` unchanged.

    Raises:
        ModelFileError: a file with experts but no ``<arch>.expert_used_count`` (the top-k would
            be a guess; llama.cpp refuses such a file too).
    """
    arch = metadata.get("general.architecture")
    if (arch in GGUF_ARCH_MODEL_TYPES or metadata.get(f"{arch}.expert_count")) and not metadata.get(f"{arch}.expert_used_count"):
        raise ModelFileError(path, f"GGUF metadata {arch}.expert_used_count (experts per token) is missing or 0")
    if arch in GGUF_ARCH_MODEL_TYPES:
        width = metadata.get(f"{arch}.expert_feed_forward_length")
        if width:
            config.moe_intermediate_size = int(width)
        shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
        if shared:
            config.shared_expert_intermediate_size = int(shared)
        return config
    experts = metadata.get(f"{arch}.expert_count") if arch == "llama" else None
    if not experts:
        return config
    from transformers import MixtralConfig

    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "transformers_version")}
    fields.update(num_local_experts=int(experts), num_experts_per_tok=int(metadata["llama.expert_used_count"]))
    return MixtralConfig(**fields)
