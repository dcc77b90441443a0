"""pagedserve: a readable LLM inference and serving engine (paged KV cache, continuous
batching, prefix caching, chunked prefill)."""
from pagedserve.entrypoints.llm import LLM
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind", "__version__"]
