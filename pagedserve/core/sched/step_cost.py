"""What a step costs, learnt from the steps the engine ran, and how many prefill tokens fit a
step-time target (``EngineConfig.max_step_ms``). Torch-free.

:class:`StepCostModel` fits, online, the wall time of one engine step (schedule + execute +
update, milliseconds) as

    step_ms ~= fixed_ms + token_ms * num_tokens + pair_ms * num_pairs / 1000

``num_tokens`` is the step's scheduled tokens (decodes and prefill chunks together);
``num_pairs`` counts attention work in (query token, key token) pairs: a chunk of ``n`` tokens
that starts with ``c`` tokens already in the cache adds ``n * c + n * (n + 1) / 2`` (a decode:
``c + 1``). Projections and the MLP cost per token; attention adds cost per pair, which is what
makes the last chunks of a 5,000-token prompt dearer than the first.

The fit is least squares over retained measurements, with every coefficient kept >= 0. The
measurements are kept by step size: the newest ``per_bucket`` of each power-of-two range of
``num_tokens``, so a long run of decode-only steps does not push out what the prefill steps
taught (and a machine that slows down is followed within a few steps of each size). The model
never extrapolates far: :meth:`StepCostModel.max_step_tokens` is twice the largest step it has
measured (at least ``COLD_START_TOKENS``), so before any measurement a step holds at most 256
tokens (a few tenths of a second for a 1B model on a CPU, against 2-4 s for 2,048 tokens of a 135M
one), and chunk sizes grow by doubling while the model learns.

:class:`StepTimeBudget` is the per-step bookkeeping the scheduler uses: the decodes of the step
are reserved first (they always run), then each prefill chunk gets the tokens that still fit
``PLAN_FRACTION`` (90 %) of the target, but the step's first chunk gets at least ``floor_tokens``
(prefills always advance). A step's target is :func:`step_target_ms`: ``max_step_ms``, or a
multiple of what the step's decodes alone are predicted to cost when that is longer (on a slow
CPU or a big model, where one decode step nears ``max_step_ms``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

COLD_START_TOKENS = 256  # most tokens of a step until twice the largest step measured is more
# The scheduler plans a step against this share of the target: measured steps scatter about
# +-5-10 % around the fit (trace: duration_ms against predicted_ms, SmolLM2 on 2 CPU cores).
PLAN_FRACTION = 0.9
_REFRESH_EVERY = 1024  # recompute the running sums from the kept measurements (no drift)
# Candidate coefficient sets (indices into (fixed, token, pair)); the per-token one is always in.
_SUBSETS = ((0, 1, 2), (0, 1), (1, 2), (1,))


def attention_pairs(num_tokens: int, num_computed_tokens: int) -> int:
    """(query, key) pairs of a chunk of ``num_tokens`` tokens after ``num_computed_tokens``
    cached ones (each query attends to every earlier token and itself)."""
    return num_tokens * num_computed_tokens + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Online least-squares fit of step time (ms) against tokens and attention pairs.

    Args:
        per_bucket: measurements kept per power-of-two range of a step's token count.
    """

    def __init__(self, per_bucket: int = 16) -> None:
        if per_bucket < 1:
            raise ValueError(f"per_bucket must be >= 1, got {per_bucket}")
        self.per_bucket = per_bucket
        self.buckets: dict[int, deque[tuple[float, float, float]]] = {}
        self.num_observed = 0
        self.max_tokens_seen = 0
        self._sums = [0.0] * 9  # see _add
        self._coef: Optional[tuple[float, float, float]] = None

    # -- measurements ---------------------------------------------------------------------
    def observe(self, num_tokens: int, num_pairs: int, duration_ms: float) -> None:
        """Add one measured step: ``num_tokens`` scheduled tokens, ``num_pairs`` attention
        pairs, ``duration_ms`` wall time. Steps with no tokens, and non-finite or negative
        durations, are ignored."""
        if num_tokens <= 0 or not math.isfinite(duration_ms) or duration_ms < 0:
            return
        obs = (float(num_tokens), num_pairs / 1000.0, float(duration_ms))
        bucket = self.buckets.setdefault(num_tokens.bit_length(), deque())
        if len(bucket) == self.per_bucket:
            self._add(bucket.popleft(), -1.0)
        bucket.append(obs)
        self._add(obs, 1.0)
        self.num_observed += 1
        self.max_tokens_seen = max(self.max_tokens_seen, num_tokens)
        if self.num_observed % _REFRESH_EVERY == 0:
            self._sums = [0.0] * 9
            for b in self.buckets.values():
                for o in b:
                    self._add(o, 1.0)
        self._coef = None

    def _add(self, obs: tuple[float, float, float], sign: float) -> None:
        t, p, y = obs  # the sums: n, Σt, Σp, Σt², Σtp, Σp², Σy, Σty, Σpy
        s = self._sums
        for i, v in enumerate((1.0, t, p, t * t, t * p, p * p, y, t * y, p * y)):
            s[i] += sign * v

    @property
    def coefficients(self) -> Optional[tuple[float, float, float]]:
        """``(fixed_ms, token_ms, pair_ms)``, all >= 0 (``pair_ms`` per 1,000 pairs); None
        before the first measurement."""
        if self._coef is None and self.num_observed:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        n, st, sp, stt, stp, spp, sy, sty, spy = self._sums
        xx = ((n, st, sp), (st, stt, stp), (sp, stp, spp))
        xy = (sy, sty, spy)
        best: Optional[tuple[float, tuple[float, float, float]]] = None
        for subset in _SUBSETS:
            theta = _ridge_solve(xx, xy, subset)
            if theta is None or any(v < 0 for v in theta):
                continue
            full = [0.0, 0.0, 0.0]
            for j, v in zip(subset, theta):
                full[j] = v
            # Residual sum of squares from the sums: Σy² is not kept; comparing
            # -2θ·Xᵀy + θᵀXᵀXθ is enough (Σy² is the same for every candidate).
            sse = -2 * sum(full[i] * xy[i] for i in range(3)) + sum(full[i] * xx[i][j] * full[j] for i in range(3) for j in range(3))
            if best is None or sse < best[0] - 1e-12 * abs(best[0]):
                best = (sse, (full[0], full[1], full[2]))
        if best is None:  # cannot happen with a positive duration; a safe answer anyway
            return (0.0, sy / max(st, 1.0), 0.0)
        return best[1]

    # -- predictions ----------------------------------------------------------------------
    def predict(self, num_tokens: int, num_pairs: int) -> Optional[float]:
        """Predicted step time (ms) of a step of ``num_tokens`` tokens and ``num_pairs``
        attention pairs; None before the first measurement."""
        c = self.coefficients
        if c is None:
            return None
        return c[0] + c[1] * num_tokens + c[2] * num_pairs / 1000.0

    def trusted_for(self, num_tokens: int) -> bool:
        """Whether a prediction for a step of ``num_tokens`` tokens interpolates rather than
        guesses: at least 3 measurements in at least 2 size ranges, the smallest of them at most
        16x ``num_tokens`` (power-of-two ranges). After one or two prefill-sized steps the fit
        spreads their time over its coefficients and a one-token step can come out at a third
        of a 256-token one."""
        return self.num_observed >= 3 and len(self.buckets) >= 2 and min(self.buckets) <= max(1, num_tokens).bit_length() + 4

    def max_step_tokens(self) -> int:
        """Most tokens a step may hold while the fit is trusted: twice the largest step
        measured, and at least ``COLD_START_TOKENS`` (tokens)."""
        return max(COLD_START_TOKENS, 2 * self.max_tokens_seen)

    def chunk_that_fits(self, limit_ms: float, num_tokens: int, num_pairs: int, num_computed_tokens: int) -> Optional[int]:
        """The most prefill tokens ``n`` that can join a step already holding ``num_tokens``
        tokens and ``num_pairs`` pairs, starting after ``num_computed_tokens`` cached tokens,
        with the predicted step time <= ``limit_ms``. 0 when nothing fits; None when the model
        has no measurement yet (no time limit known)."""
        c = self.coefficients
        if c is None:
            return None
        fixed, tok, pair = c
        room = limit_ms - (fixed + tok * num_tokens + pair * num_pairs / 1000.0)
        if room <= 0:
            return 0
        # tok*n + pair/1000 * (n*c + n(n+1)/2) <= room:  a n² + b n - room <= 0
        a = pair / 2000.0
        b = tok + pair * (num_computed_tokens + 0.5) / 1000.0
        if a <= 0.0 and b <= 0.0:
            return 1 << 30
        n = 2.0 * room / (b + math.sqrt(b * b + 4.0 * a * room))  # the positive root, stable form
        return int(min(n + 0.01, 1 << 30))  # + 0.01: 47.9999 tokens of a fit that is 48 up to rounding are 48


def _ridge_solve(xx: tuple, xy: tuple, subset: tuple[int, ...]) -> Optional[list[float]]:
    """Solve the normal equations restricted to ``subset`` with a tiny ridge (relative to each
    diagonal entry) for conditioning; None when singular."""
    k = len(subset)
    m = [[xx[i][j] + (1e-10 * xx[i][i] + 1e-12 if i == j else 0.0) for j in subset] + [xy[i]] for i in subset]
    for col in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                for j in range(col, k + 1):
                    m[r][j] -= f * m[col][j]
    return [m[i][k] / m[i][i] for i in range(k)]


def step_target_ms(model: StepCostModel, max_step_ms: float, decode_multiple: float, num_decodes: int, decode_pairs: int) -> float:
    """A prefilling step's target (ms): ``max(max_step_ms, decode_multiple x`` the predicted
    time of the step's ``num_decodes`` decodes alone (``decode_pairs`` attention pairs; a
    one-token step when there are none)). ``max_step_ms`` alone with ``decode_multiple`` 0 or
    while that prediction is not trusted (:meth:`StepCostModel.trusted_for`).

    Where a decode step costs a good part of ``max_step_ms`` (a 1B model on a few CPU cores:
    150-170 ms for 16 decodes against a 200 ms target), a fixed target leaves prefill a few
    tokens per step, at a fraction of the matmul rate. Relative to the decodes, running streams
    slow down at most ``decode_multiple`` times while prompts are prefilled, on any machine."""
    if decode_multiple <= 0 or not model.trusted_for(max(1, num_decodes)):
        return max_step_ms
    alone = model.predict(max(1, num_decodes), decode_pairs)
    return max_step_ms if alone is None else max(max_step_ms, decode_multiple * alone)


class StepTimeBudget:
    """One step's time bookkeeping for the scheduler (built by it each step).

    Args:
        model: the step-cost model.
        target_ms: the step-time target (ms).
        decode_tokens, decode_pairs: the step's decodes, reserved up front (tokens, pairs).
        floor_tokens: the least the step's first prefill chunk gets, time or not (tokens).
        block_size: chunks cut by time end on a block boundary when they can.
    """

    def __init__(self, model: StepCostModel, target_ms: float, decode_tokens: int, decode_pairs: int, floor_tokens: int, block_size: int) -> None:
        self.model = model
        self.target_ms = target_ms
        self.num_decodes = decode_tokens
        self.num_tokens = decode_tokens
        self.num_pairs = decode_pairs
        self.floor_tokens = floor_tokens
        self.block_size = block_size
        self.max_tokens = max(model.max_step_tokens(), decode_tokens)
        self.num_prefills = 0
        self.step_target_ms: Optional[float] = None  # the step's target before PLAN_FRACTION (for_step)

    @classmethod
    def for_step(
        cls, model: StepCostModel, max_step_ms: float, running: list, any_waiting: bool, block_size: int, decode_multiple: float = 0.0
    ) -> Optional["StepTimeBudget"]:
        """The budget of a step over the ``running`` requests (objects with ``num_tokens`` and
        ``num_computed_tokens``); None when nothing prefills (decodes alone are never cut).

        The step's target (ms, kept in ``step_target_ms``) is :func:`step_target_ms` of
        ``max_step_ms``, ``decode_multiple`` and the predicted time of the step's decodes
        alone; the step is planned against ``PLAN_FRACTION`` of it."""
        decodes = [r.num_computed_tokens for r in running if r.num_tokens - r.num_computed_tokens == 1]
        if not any_waiting and len(decodes) == len(running):
            return None
        pairs = sum(decodes) + len(decodes)
        target = step_target_ms(model, max_step_ms, decode_multiple, len(decodes), pairs)
        budget = cls(model, PLAN_FRACTION * target, len(decodes), pairs, max(16, block_size), block_size)
        budget.step_target_ms = target
        return budget

    def prefill_chunk(self, num_tokens: int, num_computed_tokens: int) -> int:
        """Tokens (<= ``num_tokens``, the most the token budget allows) of a prefill chunk that
        starts after ``num_computed_tokens`` cached tokens and fits the step's remaining time;
        the first chunk of a step gets at least ``min(num_tokens, floor_tokens)``."""
        if num_tokens <= 0:
            return 0
        n = min(num_tokens, max(0, self.max_tokens - self.num_tokens))
        fit = self.model.chunk_that_fits(self.target_ms, self.num_tokens, self.num_pairs, num_computed_tokens)
        if fit is not None and fit < n:
            n = fit
            end = (num_computed_tokens + n) // self.block_size * self.block_size
            if end > num_computed_tokens:  # end the chunk on a block boundary
                n = end - num_computed_tokens
        if self.num_prefills == 0:
            n = max(n, min(num_tokens, self.floor_tokens))
        return n

    def add(self, num_tokens: int, num_computed_tokens: int) -> None:
        """Count a scheduled prefill chunk against the step."""
        self.num_tokens += num_tokens
        self.num_pairs += attention_pairs(num_tokens, num_computed_tokens)
        self.num_prefills += 1
