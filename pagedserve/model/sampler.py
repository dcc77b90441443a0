"""Turn a batch of logits into next tokens, vectorised across the batch (vLLM v1 order).

Per step, the engine builds one :class:`SamplingMetadata` from the requests that sample this
step (row ``i`` of the logits belongs to ``requests[i]``), then calls :class:`Sampler`:

1. raw logprobs (``log_softmax`` of the model's logits, before any processing), only if some
   request asked for them; they are gathered after sampling;
2. ``min_tokens``: EOS ids and ``stop_token_ids`` get ``-inf`` until enough tokens are out;
3. ``logit_bias``;
4. repetition / frequency / presence penalties;
5. greedy rows (``temperature < 1e-5``): argmax of the processed logits;
6. random rows: temperature, then top-k, top-p, min-p, then the exponential race
   (``argmax(probs / q)`` with ``q ~ Exp(1)``), which samples from ``probs`` exactly.
   Seeded requests draw their row of ``q`` from their own generator, so their tokens do not
   depend on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from pagedserve.sampling_params import SamplingParams

# Below this temperature a request is greedy (same threshold as SamplingParams.greedy).
_SAMPLING_EPS = 1e-5


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
    vocab_size: int = 0
    num_reqs: int = field(default=0)

    @classmethod
    def build(cls, requests: Sequence[Any], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """Gather the sampling state of ``requests`` (one per logits row, in order).

        Each request needs ``sampling_params``, ``prompt_token_ids``, ``output_token_ids``
        (generated so far, not counting the token sampled now), ``generator`` (or ``None``) and
        ``eos_token_ids``. Token ids outside ``[0, vocab_size)`` in ``logit_bias`` or the stop
        ids are ignored.
        """
        device = torch.device(device)
        V = int(vocab_size)
        B = len(requests)
        params: list[SamplingParams] = [r.sampling_params for r in requests]

        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        temperature = torch.tensor(temps, dtype=torch.float32, device=device)
        greedy_mask = None
        if not all_greedy and not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)

        # Sampling knobs matter only for random rows.
        top_k = top_p = min_p = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            ks = [0 if g or p.top_k <= 0 or p.top_k >= V else int(p.top_k) for g, p in zip(greedy, params)]
            ps = [1.0 if g else float(p.top_p) for g, p in zip(greedy, params)]
            mps = [0.0 if g else float(p.min_p) for g, p in zip(greedy, params)]
            if any(k > 0 for k in ks):
                top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            if any(p < 1.0 for p in ps):
                top_p = torch.tensor(ps, dtype=torch.float32, device=device)
            if any(m > 0.0 for m in mps):
                min_p = torch.tensor(mps, dtype=torch.float32, device=device)
            for i, (g, r) in enumerate(zip(greedy, requests)):
                gen = getattr(r, "generator", None)
                if not g and gen is not None:
                    generators[i] = gen

        asked = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(asked) if asked else None

        # Penalties: token tensors only for rows that use them.
        pen_rows = [
            i
            for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        no_penalties = not pen_rows
        prompt_ids = output_ids = rep = freq = pres = None
        if not no_penalties:
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
            prompt_ids = _pad_rows([requests[i].prompt_token_ids for i in pen_rows], pen_rows, B, V, device)
            output_ids = _pad_rows([requests[i].output_token_ids for i in pen_rows], pen_rows, B, V, device)

        # logit_bias: sparse (row, token, value) triples.
        lb_rows: list[int] = []
        lb_cols: list[int] = []
        lb_vals: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                for t, v in p.logit_bias.items():
                    if 0 <= t < V:
                        lb_rows.append(i)
                        lb_cols.append(int(t))
                        lb_vals.append(float(v))
        lb_r = lb_c = lb_v = None
        if lb_rows:
            lb_r = torch.tensor(lb_rows, dtype=torch.int64, device=device)
            lb_c = torch.tensor(lb_cols, dtype=torch.int64, device=device)
            lb_v = torch.tensor(lb_vals, dtype=torch.float32, device=device)

        # min_tokens: block EOS and stop ids while too few tokens are out.
        mt_rows: list[int] = []
        mt_cols: list[int] = []
        for i, (r, p) in enumerate(zip(requests, params)):
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                stop_ids = set(getattr(r, "eos_token_ids", None) or ())
                stop_ids.update(p.stop_token_ids or ())
                stop_ids.update(getattr(p, "_all_stop_token_ids", None) or ())
                for t in sorted(stop_ids):
                    if 0 <= t < V:
                        mt_rows.append(i)
                        mt_cols.append(int(t))
        mt_r = mt_c = None
        if mt_rows:
            mt_r = torch.tensor(mt_rows, dtype=torch.int64, device=device)
            mt_c = torch.tensor(mt_cols, dtype=torch.int64, device=device)

        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            no_penalties=no_penalties,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            logit_bias_rows=lb_r,
            logit_bias_cols=lb_c,
            logit_bias_values=lb_v,
            min_tokens_rows=mt_r,
            min_tokens_cols=mt_c,
            vocab_size=V,
            num_reqs=B,
        )


def _pad_rows(
    token_lists: list[list[int]], rows: list[int], num_rows: int, pad: int, device: torch.device
) -> torch.Tensor:
    """``[num_rows, L]`` int64 holding ``token_lists[j]`` in row ``rows[j]``, padded with ``pad``.

    ``L >= 1`` so scatters over it are well formed even when every list is empty.
    """
    L = max(1, max((len(t) for t in token_lists), default=0))
    out = torch.full((num_rows, L), pad, dtype=torch.int64)
    for r, toks in zip(rows, token_lists):
        if toks:
            out[r, : len(toks)] = torch.as_tensor(toks, dtype=torch.int64)
    # Ids outside the vocabulary land in the (dropped) padding column.
    out.clamp_(0, pad)
    return out.to(device, non_blocking=True)


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


class Sampler(torch.nn.Module):
    """Batched sampler: ``forward(logits [B, V], metadata) -> SamplerOutput``."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[B, V]``, any float dtype)."""
        logits = logits.float()  # no copy when already fp32; processing below is out-of-place
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        lp, ids, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp, logprob_token_ids=ids, sampled_ranks=ranks)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """min_tokens, logit_bias and penalties on ``[B, V]`` float32 logits (before temperature).

        Returns a new tensor when anything applies, else ``logits`` itself (never modified).
        """
        copied = False
        if metadata.min_tokens_rows is not None:
            logits = logits.clone()
            copied = True
            logits[metadata.min_tokens_rows, metadata.min_tokens_cols] = float("-inf")
        if metadata.logit_bias_rows is not None:
            if not copied:
                logits = logits.clone()
                copied = True
            logits.index_put_(
                (metadata.logit_bias_rows, metadata.logit_bias_cols), metadata.logit_bias_values, accumulate=True
            )
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
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``[B]`` int64 tokens from processed ``[B, V]`` float32 logits."""
        greedy = None
        if not metadata.all_random:
            greedy = logits.argmax(dim=-1)
            if metadata.all_greedy:
                return greedy

        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        random = random_sample(probs, metadata.generators)

        if greedy is None:
            return random
        return torch.where(metadata.greedy_mask, greedy, random)


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
    """
    B, V = logits.shape
    counts = torch.zeros((B, V + 1), dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))
    counts = counts[:, :V]
    output_mask = counts > 0
    prompt_mask = torch.zeros((B, V + 1), dtype=torch.bool, device=logits.device)
    prompt_mask.scatter_(1, prompt_token_ids, True)
    seen = prompt_mask[:, :V] | output_mask

    rep = repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalties.unsqueeze(1) * counts
    logits = logits - presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
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
    return probs.div(q).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled-token and top-``k`` logprobs.

    Args:
        logprobs: ``[B, V]`` float32 raw logprobs.
        sampled: ``[B]`` int64 sampled ids.
        k: number of top logprobs (may be 0; capped at ``V``).

    Returns:
        ``([B, k+1] float32 logprobs, [B, k+1] int64 ids, [B] int64 ranks)``, the sampled token
        in column 0; rank = 1 + number of tokens with a strictly larger logprob.
    """
    sampled = sampled.to(torch.int64)
    k = min(k, logprobs.shape[-1])
    token_lp = logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
        lp = torch.cat([token_lp, top_lp], dim=1)
        ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
    else:
        lp, ids = token_lp, sampled.unsqueeze(1)
    return lp, ids.to(torch.int64), ranks.to(torch.int64)
