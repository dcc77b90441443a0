"""Verify draft tokens (speculative decoding) against the model's own distribution.

For a request with drafts ``d_0 .. d_{k-1}`` the model scored ``k + 1`` positions in one pass:
row ``j`` gives the distribution of the token after ``d_{j-1}`` (row 0: after the last sampled
token). Draft ``d_j`` is kept while every earlier draft was kept and

* greedy requests: ``d_j`` is the argmax of row ``j`` (so the output is what decoding one
  token at a time gives, bit for bit where a row is computed as a decode computes it: the bf16
  CPU kernels);
* random requests: ``u < p_j(d_j)`` with ``u ~ U[0, 1)``, where ``p_j`` is row ``j`` after the
  request's temperature, top-k, top-p and min-p. At the first rejected draft the token is drawn
  from ``p_j`` with ``d_j`` removed (renormalised); when every draft is kept, one more token is
  drawn from row ``k``. With a proposer that puts all its mass on its draft, this is the
  rejection rule of Leviathan et al. (ICML 2023) and Chen et al. (2023, "Accelerating Large
  Language Model Decoding with Speculative Sampling"): each kept or drawn token is distributed
  exactly as ``p_j``.

Row ``j``'s sampling state counts drafts ``d_0 .. d_{j-1}`` as already output (the caller's
``SamplingMetadata``), so penalties, bad words and min_tokens are those of decoding one token
at a time; a grammar's mask for row ``j`` (its state after those drafts) is applied to the
logits before this is called.
"""

from __future__ import annotations

import torch

from pagedserve.model.sampler import Sampler, random_sample, sampling_probs, torch_argmax
from pagedserve.model.sampling_metadata import SamplingMetadata


def rejection_sample(
    logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: torch.Tensor, num_drafts: list[int], argmax=torch_argmax
) -> tuple[list[int], list[int]]:
    """Verify the drafts of a batch of requests.

    Args:
        logits: ``[R, V]``, ``R = sum(num_drafts) + len(num_drafts)``: each request's
            ``num_drafts[i] + 1`` rows in order.
        metadata: the sampling state of each of the ``R`` rows (a request's row repeated).
        draft_token_ids: ``[R]`` int64, the draft each row scores (``-1`` on each request's last
            row, which has none).
        num_drafts: drafts per request (``>= 0``).
        argmax: ``[R, V] -> [R]`` first index of each row's maximum.
    Returns:
        (drafts kept per request, the token after them per request).
    """
    logits = Sampler.process_logits(logits.float(), metadata)
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp(min=0)
    greedy = argmax(logits) if not metadata.all_random else None
    if metadata.all_greedy:
        accept, after = greedy == draft_token_ids, greedy
    else:
        probs = sampling_probs(logits, metadata)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        u = torch.rand(len(probs), device=probs.device)
        for i, g in metadata.generators.items():
            if u.device.type == "cuda":  # no device->host sync
                u[i : i + 1] = torch.rand(1, generator=g, device=g.device)
            else:
                u[i] = torch.rand(1, generator=g, device=g.device).item()
        p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        accept = has_draft & (u < p_draft)
        residual = probs.scatter(1, drafts.unsqueeze(1), torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
        after = random_sample(residual, metadata.generators)
        if greedy is not None:
            accept = torch.where(metadata.greedy_mask, greedy == draft_token_ids, accept)
            after = torch.where(metadata.greedy_mask, greedy, after)
    if accept.device.type == "cuda":  # one device->host copy
        accept_l, after_l = torch.stack([accept.to(torch.int64), after.to(torch.int64)]).tolist()
    else:
        accept_l = accept.tolist()
        after_l = after.tolist()
    kept, tokens, start = [], [], 0
    for k in num_drafts:
        a = 0
        while a < k and accept_l[start + a]:
            a += 1
        kept.append(a)
        tokens.append(int(after_l[start + a]))
        start += k + 1
    return kept, tokens
