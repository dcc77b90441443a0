"""The scheduler's part in speculative decoding (:class:`Drafter`), and the n-gram proposer.
Torch-free.

A decode whose request may speculate is scheduled as ``1 + k`` tokens: its last sampled token
and ``k`` drafts (``SchedulerOutput.scheduled_spec_decode_tokens``), with blocks for all of
them; ``num_computed_tokens`` advances by ``1 + k`` as for any chunk. The worker scores every
position, keeps the drafts up to the first one the request's sampling rejects and samples one
token after them (``ModelRunnerOutput.num_accepted_tokens`` and ``sampled``). The update then
appends the accepted drafts and that token and takes the rejected drafts back off
``num_computed_tokens``: their K/V sits in slots past the request's computed tokens, which the
next step's tokens overwrite, and no block holding them is ever hashed (only full blocks of
accepted tokens are). After vLLM v1's scheduler (``spec_token_ids``, ``num_rejected``).
"""

from __future__ import annotations

import numpy as np

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.outputs import SchedulerStats
from pagedserve.core.request import Request
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.core.structured_output import StructuredOutputManager
from pagedserve.spec_decode_config import SpeculativeConfig


def propose_ngram(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence: the tokens that followed the latest earlier
    occurrence of its longest suffix of ``min_n`` to ``max_n`` tokens (prompt lookup).

    Args:
        token_ids: ``[L]`` int64, the request's prompt and output so far.
    Returns:
        the drafts (possibly fewer than ``k`` near the end of the sequence; empty when no
        suffix of ``min_n`` tokens occurred before).
    """
    L = len(token_ids)
    if L < min_n + 1 or k < 1:
        return []
    # Candidate ends j < L - 1 of an earlier occurrence: token j equals the last token.
    ends = np.flatnonzero(token_ids[: L - 1] == token_ids[L - 1])
    if len(ends) == 0:
        return []
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):
        ok = alive & (ends - m >= 0)
        ok[ok] = token_ids[ends[ok] - m] == token_ids[L - 1 - m]
        alive = ok
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    j = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
    return token_ids[j + 1 : j + 1 + k].tolist()


class Drafter:
    """Proposes the draft tokens of a step's decodes and accounts for what the worker accepted.

    Args:
        spec: the parsed speculative config (``EngineConfig.speculative``).
        kv_cache_manager: the block tables (drafts take free blocks, never preempt).
        max_model_len: no drafts past it.
        stats: the scheduler's counters; ``spec_decode_*`` are counted here.
    """

    def __init__(self, spec: SpeculativeConfig, kv_cache_manager: KVCacheManager, max_model_len: int, stats: SchedulerStats) -> None:
        self.spec = spec
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.stats = stats

    def may_speculate(self, num_running: int) -> bool:
        """Whether a step over ``num_running`` requests proposes drafts at all (the batch is
        below ``disable_by_batch_size``)."""
        off_at = self.spec.disable_by_batch_size
        return off_at is None or num_running < off_at

    def draft_tokens(self, req: Request, max_drafts: int) -> list[int]:
        """Drafts for a decode of ``req`` (at most ``max_drafts``; none past ``max_tokens`` or
        ``max_model_len``; with a grammar, only the leading drafts it accepts, and none while
        the request is still thinking). Penalties, bad words, min_tokens and logprobs are
        handled per position by the worker, grammars by a mask per position."""
        if req.grammar is not None and req.in_reasoning:
            return []
        k = min(self.spec.num_speculative_tokens, max_drafts, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
        if k < 1:
            return []
        tokens = np.fromiter(req.all_token_ids, dtype=np.int64, count=req.num_tokens)
        drafts = propose_ngram(tokens, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        if req.grammar is not None and drafts:
            drafts = drafts[: StructuredOutputManager.valid_draft_prefix(req.grammar, drafts)]
        return drafts

    def add_drafts(self, scheduled: list[tuple[Request, int, int]], new_ids: set[str], budget: int, out: SchedulerOutput) -> int:
        """Extend this step's decodes of requests that were already running (``scheduled``
        entries ``(request, num_computed_tokens, 1)``) with drafts, in order, while ``budget``
        tokens and the free blocks last (so drafts never preempt anyone); returns the budget
        left. Each extended entry becomes ``(request, num_computed_tokens, 1 + k)``."""
        kv = self.kv_cache_manager
        for i, (req, num_computed, num_new) in enumerate(scheduled):
            if budget <= 0:
                break
            if num_new != 1 or num_computed != req.num_tokens - 1 or not req.output_token_ids or req.request_id in new_ids:
                continue
            room = (len(kv.req_to_blocks[req.request_id]) + kv.num_free_blocks) * kv.block_size - req.num_tokens
            drafts = self.draft_tokens(req, min(budget, room))
            if drafts and kv.allocate_slots(req, 1 + len(drafts)) is not None:
                scheduled[i] = (req, num_computed, 1 + len(drafts))
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
                budget -= len(drafts)
        return budget

    def accept(self, req: Request, drafts: list[int], num_accepted: int, token: int) -> list[int]:
        """The tokens a verified decode adds (the accepted drafts, then ``token``), with the
        rejected drafts taken off ``num_computed_tokens`` and counted."""
        num_accepted = max(0, min(num_accepted, len(drafts)))
        req.num_computed_tokens -= len(drafts) - num_accepted
        s = self.stats
        s.spec_decode_num_drafts += 1
        s.spec_decode_num_draft_tokens += len(drafts)
        s.spec_decode_num_accepted_tokens += num_accepted
        per_pos = s.spec_decode_num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[str(pos)] = per_pos.get(str(pos), 0) + 1
        return drafts[:num_accepted] + [token]
