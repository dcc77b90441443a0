"""Logprobs of sampled (or prompt) tokens and the top-k of each row, as vLLM returns them:
raw logprobs (``log_softmax`` of the logits the sampler got), the rank of the chosen token,
and the top-k with exact ties broken by the smaller token id, so that the answer does not
depend on what else was sampled in the same step."""

from __future__ import annotations

import torch


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled-token and top-``k`` logprobs.

    Args:
        logprobs: ``[B, V]`` float32 raw logprobs.
        sampled: ``[B]`` int64 sampled ids.
        k: number of top logprobs (may be 0; capped at ``V``).

    Returns:
        ``([B, k+1] float32 logprobs, [B, k+1] int64 ids, [B] int64 ranks)``, the sampled token
        in column 0; rank = 1 + number of tokens with a strictly larger logprob. Among equal
        logprobs the smaller id comes first (and is the one kept at the k-th place), so a row's
        top-``j`` is the first ``j`` of its top-``k`` whatever ``k`` its batch asks.
    """
    sampled = sampled.to(torch.int64)
    k = min(k, logprobs.shape[-1])
    token_lp = logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = top_k_by_id(logprobs, k)
        lp = torch.cat([token_lp, top_lp], dim=1)
        ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
    else:
        lp, ids = token_lp, sampled.unsqueeze(1)
    return lp, ids.to(torch.int64), ranks.to(torch.int64)


def top_k_by_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k)`` of ``[B, V]`` float rows (no NaN, ``k <= V``), with ties broken by
    the smaller index, both in their order and in which tied entries make the cut
    (``torch.topk``'s choice among equal values depends on ``k``). Returns ``([B, k] values,
    [B, k] int64 indices)``. A tie at the cut (rare: equal floats) takes a slower exact pass
    over its row (on CUDA every row takes a branch-free form of it: no device->host sync)."""
    if x.device.type == "cuda":
        return top_k_by_id_no_sync(x, k)
    V = x.shape[-1]
    vals, ids = torch.topk(x, min(k + 1, V), dim=-1)
    cut_tie = vals[:, k - 1] == vals[:, k] if k < V else torch.zeros(len(x), dtype=torch.bool, device=x.device)
    vals, ids = vals[:, :k], ids[:, :k]
    if bool(cut_tie.any()):
        rows = cut_tie.nonzero()[:, 0]
        xr = x[rows]
        kth = vals[rows, k - 1 :]
        above = xr > kth
        tied = xr == kth
        take = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        ids = ids.clone()
        ids[rows] = take.nonzero()[:, 1].view(len(rows), k)
        vals = x.gather(1, ids)
    ids, perm = ids.sort(dim=-1)  # by index, then stably by value: ties in index order
    vals = vals.gather(1, perm)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def top_k_by_id_no_sync(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_by_id` without a device->host sync (the CUDA step loop's): the exact
    tie-at-the-cut pass runs for every row, branch-free, and is kept where a row has such a
    tie. Costs ``[B, V]`` int32 scratch (only when logprobs are asked)."""
    V = x.shape[-1]
    vals, ids = torch.topk(x, min(k + 1, V), dim=-1)
    if k < V:
        kth = vals[:, k - 1 : k]
        cut_tie = vals[:, k - 1 : k] == vals[:, k : k + 1]  # [B, 1]
        above = x > kth
        tied = x == kth
        take = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        # the k taken entries (exactly k per row with a tie at the cut), smaller index first
        key = torch.where(take, V - torch.arange(V, dtype=torch.int32, device=x.device), 0)
        exact = torch.topk(key, k, dim=-1).indices
        ids = torch.where(cut_tie, exact, ids[:, :k])
        vals = x.gather(1, ids)
    ids, perm = ids.sort(dim=-1)  # by index, then stably by value: ties in index order
    vals = vals.gather(1, perm)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)
