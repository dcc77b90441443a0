"""The worker's persistent state of the requests it runs (after vLLM v1's ``InputBatch``).

One row per live request, in preallocated NumPy arrays: its token ids (prompt, then output),
its block table, and its sampling parameters. Rows are filled when a request arrives
(``NewRequestData``) and updated from each step's diffs (new block ids, sampled tokens), never
rebuilt. A step's flat batch and its :class:`SamplingMetadata` are gathered from the rows with
a few vectorised NumPy operations, so the per-step cost does not grow with Python work per
request and field.

A request's sampling state that must survive preemption (its seeded ``torch.Generator``) lives
in :class:`CachedRequestState`, kept by the model runner while the request is alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from pagedserve.model.sampling_metadata import SAMPLING_EPS, SamplingMetadata
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.token_bans import TokenBans


def fold_seed(seed: int) -> int:
    """An int64 seed as the 32 bits torch's CPU generator keeps (its Mersenne Twister takes the
    low 32, so seeds 2**32 apart drew the same tokens). Seeds in [0, 2**32) are kept; others
    are mixed by SplitMix64's finalizer (Steele et al. 2014) first, so no simple pattern of
    seeds (a negative and its positive, numbers 2**32 apart) collides."""
    if 0 <= seed < 1 << 32:
        return seed
    z = seed & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return (z ^ (z >> 31)) & 0xFFFF_FFFF


@dataclass
class CachedRequestState:
    """What the worker keeps of a live request between steps, batch row or not (a preempted
    request has no row until it is resumed).

    Attributes:
        generator: the request's own generator when it is seeded and sampled at random (on the
            CPU; on CUDA a CUDA generator, so its draws stay on the device); it keeps its
            position through preemption, so a seeded request draws the same tokens whatever
            happens to it.
        num_prompt_logprobs_done: with ``prompt_logprobs``, the prompt positions already scored
            (position ``i`` scores prompt token ``i + 1``), so a recomputed chunk sends none twice.
        pooled: with the pooling runner, what earlier chunks of the prompt contributed (see
            ``ModelRunner._pool``); reset when a chunk starts at position 0 again (preemption).
    """

    req_id: str
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    generator: Optional[torch.Generator] = None
    num_prompt_logprobs_done: int = 0  # prompt positions whose logprobs were sent (kept through preemption)
    lora_int_id: int = 0  # its LoRA adapter's id, 0 for the base model
    pooled: Optional[torch.Tensor] = None  # pooling runner: the running sum (MEAN) or first state (CLS), [hidden] float32

    @classmethod
    def create(cls, req_id: str, params: SamplingParams, eos_token_ids: list[int], device: Optional[torch.device] = None) -> "CachedRequestState":
        """``device``: where a seeded request's generator lives (None: the CPU)."""
        gen = None
        if params.seed is not None and params.temperature >= SAMPLING_EPS:
            gen = torch.Generator() if device is None else torch.Generator(device=device)
            gen.manual_seed(fold_seed(params.seed))
        return cls(req_id, params, list(eos_token_ids), gen)


@dataclass
class FlatBatch:
    """One step's tokens as a flat batch (no padding between requests): request ``i`` of
    ``order`` (decodes first, then prefill chunks) runs ``nsched[i]`` tokens from position
    ``context[i]``, rows ``ends[i] - nsched[i] .. ends[i]`` of the flat batch.

    Attributes:
        order: request ids; ``num_decodes`` of them first run one token.
        rows, nsched, context, ends: int64 ``[num_reqs]``: batch rows, scheduled tokens, tokens
            already computed, cumulative ends.
        row_rep, positions, input_ids, slots: int64 ``[num_tokens]``: each token's batch row,
            position, token id and KV slot (``block_table[row, pos // B] * B + pos % B``).
    """

    order: list[str]
    num_decodes: int
    rows: np.ndarray
    nsched: np.ndarray
    context: np.ndarray
    ends: np.ndarray
    row_rep: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    slots: np.ndarray


def flat_batch(batch: "InputBatch", num_scheduled_tokens: dict[str, int], block_size: int) -> FlatBatch:
    """The :class:`FlatBatch` of one step's ``num_scheduled_tokens`` (request id -> tokens)."""
    decode_ids: list[str] = []
    prefill_ids: list[str] = []
    for rid, n in num_scheduled_tokens.items():
        (decode_ids if n == 1 else prefill_ids).append(rid)
    order = decode_ids + prefill_ids
    rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=len(order))
    nsched = np.fromiter((num_scheduled_tokens[r] for r in order), dtype=np.int64, count=len(order))
    context = batch.num_computed_tokens[rows]
    ends = np.cumsum(nsched)
    total = int(ends[-1])
    B = block_size
    # Token t of request i is at position context[i] + (t - start of i).
    row_rep = np.repeat(rows, nsched)
    positions = np.repeat(context - (ends - nsched), nsched) + np.arange(total, dtype=np.int64)
    input_ids = batch.token_ids[row_rep, positions]
    slots = batch.block_table[row_rep, positions // B] * B + positions % B
    return FlatBatch(order, len(decode_ids), rows, nsched, context, ends, row_rep, positions, input_ids, slots)


class InputBatch:
    """Rows of up to ``max_num_reqs`` requests.

    Args:
        max_num_reqs: most rows (the scheduler's ``max_num_seqs``).
        max_model_len: longest sequence (tokens): the width of ``token_ids``.
        max_num_blocks_per_req: the width of ``block_table``.
        vocab_size: ``V`` (logits width; out-of-vocabulary bias ids are ignored).
        device: where the sampling tensors go.

    Attributes:
        token_ids: ``[max_num_reqs, max_model_len]`` int64, row r's tokens in ``[:num_tokens[r]]``.
        num_tokens, num_prompt_tokens, num_computed_tokens: ``[max_num_reqs]`` int64 (tokens;
            num_computed_tokens is the value before the current step).
        block_table: ``[max_num_reqs, max_num_blocks_per_req]`` int64; entries past
            ``num_blocks[r]`` are stale but valid block ids.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int, device: torch.device) -> None:
        R = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = np.zeros((R, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(R, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(R, dtype=np.int64)
        self.num_computed_tokens = np.zeros(R, dtype=np.int64)
        self.block_table = np.zeros((R, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(R, dtype=np.int64)
        self.req_ids: list[Optional[str]] = [None] * R
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(R - 1, -1, -1))
        # Sampling. Knobs matter only for random rows: greedy rows hold the "off" values.
        self.greedy = np.ones(R, dtype=bool)
        self.temperature = np.ones(R, dtype=np.float32)
        self.top_k = np.zeros(R, dtype=np.int64)
        self.top_p = np.ones(R, dtype=np.float32)
        self.min_p = np.zeros(R, dtype=np.float32)
        self.num_logprobs = np.full(R, -1, dtype=np.int64)
        self.has_penalties = np.zeros(R, dtype=bool)
        self.penalties = np.zeros((R, 3), dtype=np.float32)  # repetition, frequency, presence
        self.min_tokens = np.zeros(R, dtype=np.int64)
        self.stop_ids: dict[int, list[int]] = {}  # rows with min_tokens: EOS + stop ids
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.token_bans = TokenBans(vocab_size, device)  # allowed_token_ids, bad_words
        self.generators: dict[int, torch.Generator] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    # -- rows -------------------------------------------------------------------------------
    def add_request(
        self, state: CachedRequestState, prompt_token_ids: list[int], output_token_ids: list[int], block_ids: list[int], num_computed_tokens: int
    ) -> int:
        """Give a request a row; returns it.

        Raises:
            ValueError: the batch is full, the request already has a row, or it does not fit
                ``max_model_len`` / the block table width.
        """
        rid = state.req_id
        if rid in self.row_of:
            raise ValueError(f"request {rid!r} already has a batch row")
        if not self._free_rows:
            raise ValueError(f"input batch is full ({len(self.req_ids)} rows)")
        n = len(prompt_token_ids) + len(output_token_ids)
        if n > self.max_model_len or len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"request {rid!r} ({n} tokens, {len(block_ids)} blocks) does not fit the input batch")
        row = self._free_rows.pop()
        self.req_ids[row] = rid
        self.row_of[rid] = row
        p = len(prompt_token_ids)
        self.token_ids[row, :p] = prompt_token_ids
        self.token_ids[row, p:n] = output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = p
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self._set_sampling(row, state)
        return row

    def _set_sampling(self, row: int, state: CachedRequestState) -> None:
        params = state.sampling_params
        V = self.vocab_size
        greedy = params.temperature < SAMPLING_EPS
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = 0 if greedy or params.top_k <= 0 or params.top_k >= V else params.top_k
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        pen = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        self.penalties[row] = pen
        self.has_penalties[row] = pen != (1.0, 0.0, 0.0)
        self.min_tokens[row] = params.min_tokens
        if params.min_tokens:
            ids = set(state.eos_token_ids) | set(params.stop_token_ids or ()) | set(params._all_stop_token_ids or ())
            self.stop_ids[row] = sorted(t for t in ids if 0 <= t < V)
        bias = {int(t): float(v) for t, v in (params.logit_bias or {}).items() if 0 <= t < V}
        if bias:
            self.logit_bias[row] = bias
        self.token_bans.add(row, params)
        if state.generator is not None and not greedy:
            self.generators[row] = state.generator

    def remove_request(self, req_id: str) -> Optional[int]:
        """Free a request's row (no-op for a request without one); returns the freed row."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.stop_ids.pop(row, None)
        self.logit_bias.pop(row, None)
        self.token_bans.remove(row)
        self.generators.pop(row, None)
        self._free_rows.append(row)
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            n = int(self.num_blocks[row])
            self.block_table[row, n : n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)

    def append_token_ids(self, row: int, token_ids: list[int]) -> None:
        if token_ids:
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(token_ids)] = token_ids
            self.num_tokens[row] = n + len(token_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of ``rows`` (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    # -- sampling -----------------------------------------------------------------------------
    def sampling_metadata(
        self, rows: np.ndarray, num_drafts_before: Optional[np.ndarray] = None, to_device: Optional[Callable[[np.ndarray], torch.Tensor]] = None
    ) -> SamplingMetadata:
        """The sampling state of ``rows`` (one per logits row, in order), on ``device``.
        Tokens generated so far are the rows' tokens after their prompts; with
        ``num_drafts_before`` (``[len(rows)]`` int64, speculative decoding) logits row ``i``
        also counts the first ``num_drafts_before[i]`` draft tokens placed after its row's
        tokens, so penalties, bad words and min_tokens see what decoding one token at a time
        would have seen there. ``to_device``: how a per-row array becomes a device tensor
        (the CUDA step loop's staging arena); default ``torch.from_numpy(a).to(device)``."""
        dev = self.device
        num_tokens = self.num_tokens[rows] if num_drafts_before is None else self.num_tokens[rows] + num_drafts_before
        V = self.vocab_size
        B = len(rows)
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())

        def to_dev(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(dev)

        tensor = to_dev if to_device is None else to_device

        top_k = top_p = min_p = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            ks, ps, mps = self.top_k[rows], self.top_p[rows], self.min_p[rows]
            top_k = tensor(ks) if ks.any() else None
            top_p = tensor(ps) if (ps < 1.0).any() else None
            min_p = tensor(mps) if mps.any() else None
            if self.generators:
                generators = {i: self.generators[r] for i, r in enumerate(rows.tolist()) if r in self.generators}
        asked = self.num_logprobs[rows]
        max_num_logprobs = int(asked.max()) if (asked >= 0).any() else None

        pen_rows = self.has_penalties[rows]
        no_penalties = not bool(pen_rows.any())
        prompt_ids = output_ids = rep = freq = pres = None
        if not no_penalties:
            pens = self.penalties[rows]
            rep, freq, pres = (tensor(np.ascontiguousarray(pens[:, j])) for j in range(3))
            zero = np.zeros(B, dtype=np.int64)
            prompt_ids = tensor(self._padded_tokens(rows, pen_rows, zero, self.num_prompt_tokens[rows]))
            output_ids = tensor(self._padded_tokens(rows, pen_rows, self.num_prompt_tokens[rows], num_tokens))

        lb = self._pairs(rows, lambda r: self.logit_bias.get(r, {}).items()) if self.logit_bias else None
        banned = self.token_bans.mask(rows, self.token_ids, num_tokens, self.num_prompt_tokens) if self.token_bans else None
        mt = None
        if self.stop_ids:
            under = self.min_tokens[rows] > num_tokens - self.num_prompt_tokens[rows]
            if under.any():
                mt = self._pairs(rows, lambda r: ((t, 0.0) for t in self.stop_ids.get(r, ())), under)

        return SamplingMetadata(
            temperature=tensor(self.temperature[rows]),
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=tensor(greedy) if not all_greedy and not all_random else None,
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
            logit_bias_rows=lb[0] if lb else None,
            logit_bias_cols=lb[1] if lb else None,
            logit_bias_values=lb[2] if lb else None,
            banned_mask=banned,
            min_tokens_rows=mt[0] if mt else None,
            min_tokens_cols=mt[1] if mt else None,
            vocab_size=V,
            num_reqs=B,
        )

    def _padded_tokens(self, rows: np.ndarray, use: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``[B, L]`` int64: row i holds ``token_ids[rows[i], lo[i]:hi[i]]`` where ``use[i]``,
        padded with ``V`` (the dropped column of the penalty scatters); ``L >= 1``."""
        V = self.vocab_size
        L = max(1, int((hi - lo)[use].max()))
        out = np.full((len(rows), L), V, dtype=np.int64)
        for i in np.flatnonzero(use):
            seg = self.token_ids[rows[i], lo[i] : hi[i]]
            out[i, : len(seg)] = seg
        np.clip(out, 0, V, out=out)
        return out

    def _pairs(self, rows: np.ndarray, entries, mask: Optional[np.ndarray] = None):
        """(row index, token, value) triples of ``entries(row)`` over ``rows`` as three tensors,
        or None when there are none."""
        r_idx: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, r in enumerate(rows.tolist()):
            if mask is not None and not mask[i]:
                continue
            for t, v in entries(r):
                r_idx.append(i)
                cols.append(t)
                vals.append(v)
        if not r_idx:
            return None
        dev = self.device
        return (
            torch.tensor(r_idx, dtype=torch.int64, device=dev),
            torch.tensor(cols, dtype=torch.int64, device=dev),
            torch.tensor(vals, dtype=torch.float32, device=dev),
        )
