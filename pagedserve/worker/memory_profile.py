"""KV cache sizing on CUDA from a profiling run, as vLLM v1 does (``Worker.determine_available_memory``):
after the weights are loaded, run one dummy forward of ``max_num_batched_tokens`` tokens (split
over ``max_num_seqs`` fresh prompts) and one dummy sampler pass over ``max_num_seqs`` rows
(random sampling with top-k, top-p and 20 logprobs: the sampler's largest temporaries), then
read the peak of ``torch.cuda.max_memory_allocated()``. ``gpu_memory_utilization`` bounds
weights + that activation peak + what is not PyTorch's (the CUDA context, other processes) +
the KV cache, so a full batch cannot run out of memory the way a budget taken before any
forward can.

The arithmetic (:func:`kv_budget_from_profile`) and the orchestration (:func:`profile_kv_budget`)
take a memory reader, so both are tested on CPU with a fake one; :func:`profile_run` runs on
any device (tested on CPU with a tiny model). Untested on a GPU: the readings themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group
from pagedserve.model.sampler import Sampler
from pagedserve.model.sampling_metadata import SamplingMetadata
from pagedserve.ops import kv_int8

logger = logging.getLogger(__name__)

PROFILE_NUM_LOGPROBS = 20  # vLLM's default max_logprobs
PROFILE_TOP_K = 50


class MemoryReader(Protocol):
    """What the sizing reads of a device's memory (bytes); :class:`CudaMemory` on CUDA."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) on the device, all processes
    def memory_reserved(self) -> int: ...  # held by this process's caching allocator
    def max_memory_allocated(self) -> int: ...  # peak of live tensors since reset_peak
    def reset_peak(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...


class CudaMemory:
    """:class:`MemoryReader` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass
class ProfileResult:
    """What a profiling run measured (bytes).

    Attributes:
        kv_budget: what the KV cache may take.
        peak_torch: PyTorch's peak (weights + activations; the dummy KV cache left out).
        non_torch: memory in use on the device that is not this process's PyTorch pool.
        total: the device's memory.
    """

    kv_budget: int
    peak_torch: int
    non_torch: int
    total: int


def kv_budget_from_profile(total: int, utilization: float, free: int, reserved: int, peak: int, profile_kv_bytes: int) -> ProfileResult:
    """The KV budget after a profiling run: ``total * utilization`` less PyTorch's peak
    (``peak``, minus the dummy KV cache the run allocated, ``profile_kv_bytes``) and less the
    memory in use that is not in PyTorch's pool (``(total - free) - reserved``, read after the
    run with the cache emptied: the CUDA context, NCCL buffers, other processes). 0 when
    nothing is left."""
    non_torch = max(0, (total - free) - reserved)
    peak_torch = max(0, peak - profile_kv_bytes)
    budget = int(total * utilization) - peak_torch - non_torch
    return ProfileResult(max(0, budget), peak_torch, non_torch, total)


def profile_kv_budget(run: Callable[[], int], memory: MemoryReader, utilization: float) -> ProfileResult:
    """Run ``run`` (returns the bytes of the dummy KV cache it allocated) between a peak reset
    and the readings of :func:`kv_budget_from_profile`; the cache is emptied before and after."""
    memory.empty_cache()
    memory.reset_peak()
    profile_kv_bytes = run()
    memory.synchronize()
    peak = memory.max_memory_allocated()
    memory.empty_cache()
    free, total = memory.mem_get_info()
    res = kv_budget_from_profile(total, utilization, free, memory.memory_reserved(), peak, profile_kv_bytes)
    gib = 1 << 30
    logger.info(
        "pagedserve worker: profiling run: peak %.2f GiB (weights + activations), %.2f GiB outside PyTorch, %.2f GiB of %.2f GiB left for the KV cache at %.0f%%",
        res.peak_torch / gib,
        res.non_torch / gib,
        res.kv_budget / gib,
        total / gib,
        100 * utilization,
    )
    return res


def dummy_sampling_metadata(num_rows: int, vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Every row random with temperature, top-k, top-p and 20 logprobs (the sampler's
    largest temporaries: a sorted copy of the logits with int64 indices)."""
    return SamplingMetadata(
        temperature=torch.full((num_rows,), 0.7, dtype=torch.float32, device=device),
        all_greedy=False,
        all_random=True,
        greedy_mask=None,
        top_k=torch.full((num_rows,), min(PROFILE_TOP_K, vocab_size), dtype=torch.int64, device=device),
        top_p=torch.full((num_rows,), 0.9, dtype=torch.float32, device=device),
        min_p=None,
        generators={},
        max_num_logprobs=min(PROFILE_NUM_LOGPROBS, vocab_size),
        no_penalties=True,
        prompt_token_ids=None,
        output_token_ids=None,
        repetition_penalties=None,
        frequency_penalties=None,
        presence_penalties=None,
        logit_bias_rows=None,
        logit_bias_cols=None,
        logit_bias_values=None,
        min_tokens_rows=None,
        min_tokens_cols=None,
        vocab_size=vocab_size,
        num_reqs=num_rows,
    )


@torch.inference_mode()
def profile_run(model: Any, num_tokens: int, num_seqs: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, device: torch.device) -> int:
    """One dummy forward of ``num_tokens`` tokens as ``min(num_seqs, num_tokens)`` fresh prompts
    (their K/V written to a dummy cache just large enough) and one dummy sampler pass over
    ``num_seqs`` rows of logits. Returns the dummy cache's bytes."""
    n = max(1, min(num_seqs, num_tokens))
    qlens = np.full(n, num_tokens // n, dtype=np.int64)
    qlens[: num_tokens % n] += 1
    nblk = -(-qlens // block_size)
    tables = np.zeros((n, int(nblk.max())), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]])
    for i in range(n):
        tables[i, : nblk[i]] = np.arange(first[i], first[i] + nblk[i])
    num_blocks = int(nblk.sum())
    attn = model.layers[0].self_attn
    L = len(model.layers)
    if kv_cache_dtype == kv_int8.KV_INT8:
        cache = torch.zeros((L, *kv_int8.cache_shape(num_blocks, attn.num_kv_heads, block_size, attn.head_dim)), dtype=torch.int8, device=device)
    else:
        cache = torch.zeros((L, 2, num_blocks, attn.num_kv_heads, block_size, attn.head_dim), dtype=dtype, device=device)
    starts = np.repeat(np.cumsum(qlens) - qlens, qlens)
    positions = np.arange(num_tokens, dtype=np.int64) - starts
    slots = tables[np.repeat(np.arange(n), qlens), positions // block_size] * block_size + positions % block_size
    group = build_attention_group(0, qlens, np.zeros(n, dtype=np.int64), tables, block_size, device)
    meta = AttentionMetadata(torch.from_numpy(slots).to(device), [group], block_size)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, torch.from_numpy(positions).to(device), list(cache.unbind(0)), meta)
    rows = torch.arange(num_seqs, device=device) % num_tokens
    logits = model.compute_logits(hidden[rows])
    del hidden
    if logits is not None:  # None: a tensor-parallel rank > 0
        Sampler(model.backend.argmax)(logits, dummy_sampling_metadata(num_seqs, logits.shape[1], device))
    return cache.numel() * cache.element_size()
