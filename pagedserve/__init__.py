"""pagedserve: a readable LLM inference and serving engine (paged KV cache, continuous
batching, prefix caching, chunked prefill).

``import pagedserve`` is light: ``LLM``, ``SamplingParams`` and the output classes are imported
on first use (as vLLM's ``__init__`` does), so the torch-free engine core can be imported
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "EngineConfig": "pagedserve.config",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutputKind": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
    "EmbeddingOutput": "pagedserve.outputs",
    "PoolingParams": "pagedserve.pooler_config",
    "LoRARequest": "pagedserve.lora_request",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
