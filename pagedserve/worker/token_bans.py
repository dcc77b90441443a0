"""Tokens a row may not sample: vLLM's ``allowed_token_ids`` and ``bad_words``, per input-batch row.

Built once when a request gets its row (not per step): ``allowed_token_ids`` and one-token bad
words become a ``[V]`` bool mask; a longer bad word keeps its prefix, and its last token is
banned in a step where the row's output tokens end with that prefix (vLLM's rule: generated
tokens only, not the prompt). A step's ``[B, V]`` mask is gathered from those rows alone.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams


class TokenBans:
    """Args:
    vocab_size: ``V``; ids outside ``[0, V)`` are dropped (the frontend refuses them).
    device: where the masks live (the logits' device).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.static: dict[int, torch.Tensor] = {}  # row -> [V] bool, True = banned
        # row -> (prefixes [W, L] int64, right-aligned, -1 = any token; last tokens [W] int64)
        self.prefixes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __bool__(self) -> bool:
        return bool(self.static or self.prefixes)

    def add(self, row: int, params: SamplingParams) -> None:
        V, dev = self.vocab_size, self.device
        banned = None
        if params.allowed_token_ids:
            banned = torch.ones(V, dtype=torch.bool, device=dev)
            ids = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=dev)
            banned[ids[(ids >= 0) & (ids < V)]] = False
        words = [w for w in params._bad_words_token_ids if w and all(0 <= t < V for t in w)]
        single = [w[0] for w in words if len(w) == 1]
        if single:
            if banned is None:
                banned = torch.zeros(V, dtype=torch.bool, device=dev)
            banned[torch.tensor(single, dtype=torch.int64, device=dev)] = True
        if banned is not None:
            self.static[row] = banned
        longer = [w for w in words if len(w) > 1]
        if longer:
            L = max(len(w) for w in longer) - 1
            prefixes = np.full((len(longer), L), -1, dtype=np.int64)
            for i, w in enumerate(longer):
                prefixes[i, L - (len(w) - 1) :] = w[:-1]
            self.prefixes[row] = (prefixes, np.array([w[-1] for w in longer], dtype=np.int64))

    def remove(self, row: int) -> None:
        self.static.pop(row, None)
        self.prefixes.pop(row, None)

    def mask(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, num_prompt_tokens: np.ndarray) -> Optional[torch.Tensor]:
        """``[B, V]`` bool, True where a token is banned this step for ``rows[i]`` (all False
        for rows without bans); None when nothing is banned. ``token_ids`` /
        ``num_prompt_tokens``: the input batch's arrays (all rows); ``num_tokens``: ``[B]``, the
        tokens of ``rows[i]`` that come before logits row ``i``."""
        row_list = rows.tolist()
        static = [(i, self.static[r]) for i, r in enumerate(row_list) if r in self.static]
        dynamic: list[tuple[int, np.ndarray]] = []
        for i, r in enumerate(row_list):
            if r in self.prefixes:
                prefixes, last = self.prefixes[r]
                L = prefixes.shape[1]
                n = int(num_tokens[i])
                k = min(L, n - int(num_prompt_tokens[r]))
                tail = np.full(L, -2, dtype=np.int64)  # -2 matches no token: fewer outputs than the prefix
                if k:
                    tail[L - k :] = token_ids[r, n - k : n]
                hit = ((prefixes == tail) | (prefixes == -1)).all(axis=1)
                if hit.any():
                    dynamic.append((i, last[hit]))
        if not static and not dynamic:
            return None
        out = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device=self.device)
        for i, m in static:
            out[i] = m
        for i, ids in dynamic:
            out[i, torch.from_numpy(ids).to(self.device)] = True
        return out
