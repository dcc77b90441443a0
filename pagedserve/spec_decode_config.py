"""SpeculativeConfig: speculative decoding's part of :class:`pagedserve.config.EngineConfig`
(its ``speculative_config`` field, ``--speculative-config`` JSON, parsed by
:func:`pagedserve.config.dataclass_from_value`), in vLLM's shape. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The most draft tokens a step may verify per request: each one costs a token of compute.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given


@dataclass
class SpeculativeConfig:
    """Speculative decoding by n-gram matching ("prompt lookup"), vLLM's ``--speculative-config``.

    Each decode step, a running request whose last ``n`` tokens (``prompt_lookup_min <= n <=
    prompt_lookup_max``, the longest that matches) occurred earlier in its prompt or output
    proposes the ``num_speculative_tokens`` tokens that followed that occurrence; the model
    scores the request's next token and every draft in one pass, and the drafts are kept up to
    the first one the request's own sampling would not have produced (Leviathan et al., "Fast
    Inference from Transformers via Speculative Decoding", ICML 2023; n-gram proposals after
    Saxena's prompt lookup decoding and vLLM's ``NgramProposer``).

    Attributes:
        method: "ngram" (the one method: it needs no draft model).
        num_speculative_tokens: the most drafts per request and step (1-16).
        prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix (tokens) matched;
            one alone sets both, neither gives 5 and 5 (as vLLM); 1 <= min <= max <= 64.
        disable_by_batch_size: no drafts in a step when this many requests or more are
            running (the batch already uses the compute drafts would take); None = always.
    Raises:
        ValueError: an unknown key or method, or a value out of range.
    """

    method: str = "ngram"
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; the one method is 'ngram' "
                "(draft-model methods such as eagle or draft_model need a second model)"
            )

        def whole(name: str, lo: int, hi: Optional[int] = None) -> None:
            v = getattr(self, name)
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
                raise ValueError(f"speculative_config {name} must be a whole number {bound}, got {v!r}")

        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        whole("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        whole("prompt_lookup_max", 1, MAX_PROMPT_LOOKUP)
        whole("prompt_lookup_min", 1, MAX_PROMPT_LOOKUP)
        whole("disable_by_batch_size", 1)
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
