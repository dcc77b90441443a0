"""Per-step sampling state of a batch, as tensors on the model's device.

Built by the worker's persistent input batch (``pagedserve.worker.input_batch``) from the rows
that sample this step, consumed by :class:`pagedserve.model.sampler.Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Below this temperature a request is greedy (same threshold as SamplingParams.greedy).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling state of a batch of ``B`` requests, as tensors on the model's device.

    Optional tensors are ``None`` when no request in the batch uses the feature, so a batch of
    plain greedy requests costs a handful of Python scalars and one ``[B]`` tensor.

    Attributes:
        temperature: ``[B]`` float32; greedy rows hold 1.0 (they are never divided).
        greedy_mask: ``[B]`` bool, True for greedy rows; ``None`` unless the batch is mixed.
        all_greedy / all_random: every row greedy / every row random.
        top_k: ``[B]`` int64, 0 = off; ``None`` if no request uses top-k.
        top_p: ``[B]`` float32, 1.0 = off; ``None`` if no request uses top-p.
        min_p: ``[B]`` float32, 0.0 = off; ``None`` if no request uses min-p.
        generators: row index -> ``torch.Generator`` for the seeded random rows.
        max_num_logprobs: largest ``logprobs`` asked for in the batch, ``None`` if nobody asked.
        no_penalties: no row has a repetition / frequency / presence penalty.
        prompt_token_ids: ``[B, Lp]`` int64, padded with ``vocab_size``; rows without penalties
            are all padding. ``None`` when ``no_penalties``.
        output_token_ids: ``[B, Lo]`` int64, padded with ``vocab_size``; ``None`` when
            ``no_penalties``.
        repetition_penalties / frequency_penalties / presence_penalties: ``[B]`` float32
            (1.0 / 0.0 / 0.0 = off); ``None`` when ``no_penalties``.
        logit_bias_rows / logit_bias_cols: ``[N]`` int64 (row, token) of each bias entry, and
            logit_bias_values: ``[N]`` float32; all ``None`` if no request has a bias.
        min_tokens_rows / min_tokens_cols: ``[M]`` int64 (row, token) pairs to set to ``-inf``
            (stop / EOS ids of rows still under ``min_tokens``); ``None`` if there are none.
        banned_mask: ``[B, V]`` bool, True for tokens outside a row's ``allowed_token_ids`` or
            that ``bad_words`` ban this step (all False for other rows); ``None`` if nothing is
            banned.
        vocab_size: ``V``, the width of the logits.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    greedy_mask: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]
    min_p: Optional[torch.Tensor]
    generators: dict[int, torch.Generator]
    max_num_logprobs: Optional[int]
    no_penalties: bool
    prompt_token_ids: Optional[torch.Tensor]
    output_token_ids: Optional[torch.Tensor]
    repetition_penalties: Optional[torch.Tensor]
    frequency_penalties: Optional[torch.Tensor]
    presence_penalties: Optional[torch.Tensor]
    logit_bias_rows: Optional[torch.Tensor]
    logit_bias_cols: Optional[torch.Tensor]
    logit_bias_values: Optional[torch.Tensor]
    min_tokens_rows: Optional[torch.Tensor]
    min_tokens_cols: Optional[torch.Tensor]
    banned_mask: Optional[torch.Tensor] = None
    vocab_size: int = 0
    num_reqs: int = field(default=0)
