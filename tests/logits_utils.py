"""Recording the logits rows an offline engine's model computes (the rows the sampler sees)."""

from __future__ import annotations

import torch


class capture_logits:
    """Record the logits rows our model computes (the rows the sampler sees) while active:
    ``with capture_logits(llm) as cap: ...`` then ``cap.rows`` (float32 copies)."""

    def __init__(self, llm) -> None:
        self.model = llm.llm_engine.core.worker.model_runner.model
        self.rows: list[torch.Tensor] = []

    def __enter__(self) -> "capture_logits":
        orig = type(self.model).compute_logits

        def wrapped(hidden):
            logits = orig(self.model, hidden)
            self.rows.append(logits.detach().float().clone())
            return logits

        self.model.compute_logits = wrapped
        return self

    def __exit__(self, *exc) -> None:
        del self.model.compute_logits
