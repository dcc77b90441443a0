"""Turn a batch of logits into next tokens, vectorised across the batch (vLLM v1 order).

Per step, the worker's input batch builds one :class:`SamplingMetadata` from the requests that
sample this step (row ``i`` of the logits belongs to the ``i``-th of them), then calls
:class:`Sampler`:

1. raw logprobs (``log_softmax`` of the model's logits, before any processing), only if some
   request asked for them; they are gathered after sampling;
2. ``allowed_token_ids``: every other token gets ``-inf``, as do ``bad_words``' tokens where
   the output ends with the rest of the word (``pagedserve.worker.token_bans``);
   ``min_tokens``: EOS ids and ``stop_token_ids`` get ``-inf`` until enough tokens are out;
3. ``logit_bias``;
4. repetition / frequency / presence penalties;
5. greedy rows (``temperature < 1e-5``): argmax of the processed logits;
6. random rows: temperature, then top-k, top-p, min-p, then the exponential race
   (``argmax(probs / q)`` with ``q ~ Exp(1)``), which samples from ``probs`` exactly.
   Seeded requests draw their row of ``q`` from their own generator, so their tokens do not
   depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.model.logprobs import gather_logprobs
from pagedserve.model.sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of ``B`` rows.

    Attributes:
        sampled_token_ids: ``[B]`` int64.
        logprobs: ``[B, k + 1]`` float32, raw logprob of the sampled token in column 0, then the
            top-``k`` raw logprobs (``k`` = max ``logprobs`` asked in the batch); ``None`` if no
            request asked. Rows that asked fewer than ``k`` take a prefix.
        logprob_token_ids: ``[B, k + 1]`` int64, the sampled token id then the top-``k`` ids.
        sampled_ranks: ``[B]`` int64, rank of the sampled token under the raw distribution
            (1 = most likely; ``1 + number of tokens with a strictly larger logprob``).
    """

    sampled_token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    logprob_token_ids: Optional[torch.Tensor] = None
    sampled_ranks: Optional[torch.Tensor] = None


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
    """Structured output, in place: ``logits[rows[i], t] = -inf`` wherever bit ``t`` of row ``i``
    of ``bitmask`` is 0 (``[len(rows), ceil(V / 32)]`` little-endian int32 bytes, from
    ``StructuredOutputManager.grammar_bitmask``). ``logits``: ``[B, V]``."""
    import numpy as np

    V = logits.shape[1]
    words = torch.from_numpy(np.frombuffer(bitmask, dtype="<i4").reshape(len(rows), -1).copy()).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :V]
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 index of each row's largest value, the first on ties (``max(-1)``, which
    computes ``argmax(-1)``'s answer 2.5x faster on the CPU)."""
    return x.max(dim=-1).indices


class Sampler(torch.nn.Module):
    """Batched sampler: ``forward(logits [B, V], metadata) -> SamplerOutput``.

    Args:
        argmax: ``[B, V] -> [B]`` first index of each row's maximum (the model backend's,
            e.g. a C kernel over bf16 logits); PyTorch's by default.
    """

    def __init__(self, argmax=torch_argmax) -> None:
        super().__init__()
        self.argmax = argmax

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[B, V]``, any float dtype)."""
        if metadata.all_greedy and metadata.max_num_logprobs is None and not _processes_logits(metadata):
            # The argmax of bf16 logits is that of their exact fp32 copy: skip the copy.
            return SamplerOutput(sampled_token_ids=self.argmax(logits))
        logits = logits.float()  # no copy when already fp32; processing below is out-of-place
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata, self.argmax)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        lp, ids, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp, logprob_token_ids=ids, sampled_ranks=ranks)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """allowed_token_ids / bad_words, min_tokens, logit_bias and penalties on ``[B, V]``
        float32 logits (before temperature).

        Returns a new tensor when anything applies, else ``logits`` itself (never modified).
        """
        copied = False
        if metadata.banned_mask is not None:
            # torch.where, not masked_fill: much faster when most entries are banned (docs/perf-history.md, "Sampling bans")
            logits = torch.where(metadata.banned_mask, float("-inf"), logits)
            copied = True
        if metadata.min_tokens_rows is not None:
            logits = logits.clone()
            copied = True
            logits[metadata.min_tokens_rows, metadata.min_tokens_cols] = float("-inf")
        if metadata.logit_bias_rows is not None:
            if not copied:
                logits = logits.clone()
                copied = True
            logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_cols), metadata.logit_bias_values, accumulate=True)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalties,
                metadata.frequency_penalties,
                metadata.presence_penalties,
            )
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata, argmax=torch_argmax) -> torch.Tensor:
        """``[B]`` int64 tokens from processed ``[B, V]`` float32 logits."""
        greedy = None
        if not metadata.all_random:
            greedy = argmax(logits)
            if metadata.all_greedy:
                return greedy

        random = random_sample(sampling_probs(logits, metadata), metadata.generators)

        if greedy is None:
            return random
        return torch.where(metadata.greedy_mask, greedy, random)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``[B, V]`` probabilities of processed float32 logits after each row's temperature, top-k,
    top-p and min-p (not renormalised after min-p)."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = torch.softmax(logits, dim=-1)
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    return probs


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties, out of place.

    Args:
        logits: ``[B, V]`` float32.
        prompt_token_ids: ``[B, Lp]`` int64 padded with ``V``.
        output_token_ids: ``[B, Lo]`` int64 padded with ``V``.
        repetition_penalties, frequency_penalties, presence_penalties: ``[B]`` float32.

    Returns:
        ``[B, V]``: for tokens in prompt or output, ``logit / rep`` if ``logit > 0`` else
        ``logit * rep``; then ``- freq * count_in_output - presence * (count_in_output > 0)``.

    Only the entries of tokens a row has seen are computed (gathered, penalised, scattered
    back into a copy), so the cost grows with the tokens, not ``B x V``; each value is the
    dense formula's to the bit. A row's padding points at its smallest seen id, whose value
    it then writes again.
    """
    B, V = logits.shape
    counts = torch.zeros((B, V + 1), dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))
    ids = torch.cat([prompt_token_ids, output_token_ids], dim=1)
    first = ids.min(dim=1, keepdim=True).values  # V: the row has seen nothing
    has_seen = first < V
    ids = torch.where(ids < V, ids, torch.where(has_seen, first, 0))
    x = logits.gather(1, ids)
    c = counts.gather(1, ids)
    rep = repetition_penalties.unsqueeze(1)
    val = torch.where(x > 0, x / rep, x * rep)
    val = val - frequency_penalties.unsqueeze(1) * c
    val = val - presence_penalties.unsqueeze(1) * (c > 0).to(logits.dtype)
    return logits.clone().scatter_(1, ids, torch.where(has_seen, val, x))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask ``[B, V]`` logits to ``-inf`` outside each row's top-k, then outside its top-p set.

    One descending sort for the batch. ``top_k`` (``[B]`` int64, 0 = off) keeps the tokens whose
    logit is at least the k-th largest (ties with it are kept). ``top_p`` (``[B]`` float32,
    1 = off) keeps the smallest prefix of the sorted, top-k-renormalised distribution whose mass
    is ``>= top_p`` -- always at least the top token. Rows with the feature off are untouched.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    drop = None
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(1, V)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
        drop = sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each position
        p_drop = mass_before >= top_p.unsqueeze(1)
        p_drop[:, 0] = False
        p_drop &= (top_p < 1.0).unsqueeze(1)  # off rows stay bit-identical to running alone
        drop = p_drop if drop is None else drop | p_drop
    if drop is None:
        return logits
    mask = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero ``[B, V]`` probs below ``min_p * max prob`` of their row (``min_p``: ``[B]``, 0 = off).

    The top token is always kept; the result is not renormalised (the race does not need it).
    """
    top = probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < min_p.unsqueeze(1) * top, 0.0)


def _processes_logits(metadata: SamplingMetadata) -> bool:
    """Whether ``process_logits`` changes anything for this batch."""
    return (
        metadata.min_tokens_rows is not None or metadata.logit_bias_rows is not None or metadata.banned_mask is not None or not metadata.no_penalties
    )


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[B]`` int64: ``argmax(probs / q)`` with ``q ~ Exp(1)``, an exact draw from each row.

    Rows in ``generators`` draw their ``q`` from that generator (on the generator's device,
    then copied), so a seeded request's draws do not depend on its batch neighbours; the other
    rows are drawn together from the default generator.
    """
    B, V = probs.shape
    q = torch.empty_like(probs)
    if len(generators) < B:
        q.exponential_()
    for i, g in generators.items():
        if g.device == probs.device:
            q[i].exponential_(generator=g)
        else:
            q[i].copy_(torch.empty(V, dtype=probs.dtype, device=g.device).exponential_(generator=g))
    # An exact 0 in q would turn a masked token's 0 prob into NaN, which argmax picks.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return torch_argmax(probs.div(q))
