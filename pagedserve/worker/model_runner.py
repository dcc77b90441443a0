"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the model, the KV cache tensors and the sampler; it never decides who runs.
Per step it builds the flat batch (``input_ids``, ``positions``, ``slot_mapping``), the
attention groups (decodes, then prefill chunks), runs the model, computes logits only for the
last scheduled token of each request that samples, and samples.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.model.attention import AttentionMetadata, build_attention_group
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim * elem


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step.

    Attributes:
        sampled: request id -> sampled token id (only requests whose chunk reached the end).
        logprobs: request id -> (token ids, logprobs, rank of the sampled token); the sampled
            token comes first, then the top-k, for requests that asked for logprobs.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over a paged KV cache.

    Args:
        model: a loaded LlamaForCausalLM (weights on ``device``, in the KV dtype).
        num_blocks: KV cache pool size (blocks); the cache is
            ``num_layers x [2, num_blocks, num_kv_heads, block_size, head_dim]``.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        attn = model.layers[0].self_attn
        shape = (cfg.num_hidden_layers, 2, num_blocks, attn.num_kv_heads, block_size, attn.head_dim)
        # Zero-filled: padded block-table entries read stale slots that are masked out, and
        # masking needs them finite.
        # (2 MiB pages for the pool were tried: W1 577 -> 551 tok/s, batch-1 attention unchanged.)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput()
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        B = self.block_size
        groups = []
        logits_indices: list[int] = []
        sampling_reqs: list[ScheduledRequest] = []
        for part in (decodes, prefills):
            if not part:
                continue
            groups.append(
                build_attention_group(
                    len(input_ids),
                    [s.num_new_tokens for s in part],
                    [s.num_computed_tokens for s in part],
                    [s.block_ids for s in part],
                    B,
                    self.device,
                )
            )
            for s in part:
                start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
                input_ids.extend(s.request.all_token_ids[start:end])
                positions.extend(range(start, end))
                ids = s.block_ids
                slots.extend(ids[p // B] * B + p % B for p in range(start, end))
                if s.samples:
                    logits_indices.append(len(input_ids) - 1)
                    sampling_reqs.append(s)

        dev = self.device
        input_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev), groups, B)
        hidden = self.model(input_t, pos_t, self.kv_caches, meta)

        out = ModelRunnerOutput()
        if not sampling_reqs:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(logits_indices, device=dev)])
        reqs = [s.request for s in sampling_reqs]
        smeta = SamplingMetadata.build(reqs, self.vocab_size, dev)
        res = self.sampler(logits, smeta)
        tokens = res.sampled_token_ids.tolist()
        for r, t in zip(reqs, tokens):
            out.sampled[r.request_id] = t
        if res.logprobs is not None:
            lp = res.logprobs.tolist()
            ids = res.logprob_token_ids.tolist()
            ranks = res.sampled_ranks.tolist()
            for i, r in enumerate(reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    out.logprobs[r.request_id] = (ids[i][: k + 1], lp[i][: k + 1], ranks[i])
        return out
