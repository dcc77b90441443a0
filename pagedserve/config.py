"""Engine configuration, with vLLM's parameter names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    """Everything that shapes an engine instance.

    Attributes:
        model: HF model directory or .gguf file; None = the default SmolLM2-135M-Instruct.
        dtype: "auto" (bfloat16 on CUDA and on CPUs with AVX-512 BF16, else float32),
            "float32", "bfloat16" or "float16". Weights and KV cache use it.
        block_size: tokens per KV cache block.
        max_model_len: longest sequence (prompt + output, tokens); None = the model's
            max_position_embeddings, lowered to what the KV cache can hold.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (tokens); None = max(2048, max_model_len
            when chunked prefill is off).
        kv_cache_memory_bytes: KV cache budget (bytes); None = a share of free memory
            (CPU: 20% of available RAM, at most 4 GiB; CUDA: gpu_memory_utilization).
        num_kv_blocks: set the pool size directly (blocks); overrides the memory budget.
        gpu_memory_utilization: fraction of GPU memory the engine may use (CUDA only).
        enable_prefix_caching: reuse KV blocks across requests by chained block hashes.
        enable_chunked_prefill: split long prompts across steps under the token budget.
        long_prefill_token_threshold: cap on one request's prefill chunk per step (0 = none).
        seed: global seed (sampling of requests without their own seed).
        device: "auto" (CUDA when available, else CPU), "cpu" or "cuda".
        served_model_name: name reported by the API; default: the model's name.
    """

    model: Optional[str] = None
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    seed: int = 0
    device: str = "auto"
    served_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
