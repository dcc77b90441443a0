"""Reasoning outputs (vLLM's ``--reasoning-parser``): a thinking model's text before
``</think>`` is returned as the chat message's ``reasoning_content`` (and ``reasoning``, vLLM's
newer name), the rest as ``content``. Parsers, as vLLM's:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the chat template may put ``<think>`` in
  the prompt, so the output is reasoning until ``</think>``; the first ``<think>`` in the
  reasoning is dropped; without ``</think>`` (cut by max_tokens) everything is reasoning.
- ``qwen3``: the same, except that ``chat_template_kwargs: {"enable_thinking": false}`` makes
  the whole output content.

A prompt that already closed its thinking block (``</think>`` after the last ``<think>``, as
templates do when thinking is switched off) makes the whole output content. The engine does
not constrain a thinking request's tokens (structured output, forced tool calls) until it has
generated ``</think>`` (see ``pagedserve.core.sched.stop``), as vLLM. Both tags must be single
tokens of the model's vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.entrypoints.openai.tool_parsers import _partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_id: int
    end_id: int

    @classmethod
    def load(cls, name: str, tokenizer: Any) -> "ReasoningParser":
        """Raises ValueError: an unknown parser, or a tokenizer without single
        ``<think>`` / ``</think>`` tokens."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        ids = []
        for tag in (THINK_START, THINK_END):
            got = tokenizer(tag, add_special_tokens=False)["input_ids"]
            if len(got) != 1:
                raise ValueError(f"--reasoning-parser {name}: the model's tokenizer has no single {tag} token "
                                 f"(it reads as {len(got)} tokens); this model does not think in {THINK_START} blocks")
            ids.append(got[0])
        return cls(name, ids[0], ids[1])

    def thinks(self, prompt_token_ids: list[int], chat_template_kwargs: Optional[dict] = None) -> bool:
        """Whether the output of this prompt starts in reasoning."""
        if self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
            return False
        for t in reversed(prompt_token_ids):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        return True

    @staticmethod
    def split(text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a thinking request's whole output; None for an empty part
        that has no tag (content after ``</think>`` is None when nothing follows it)."""
        reasoning, found, content = text.partition(THINK_END)
        before, started, after = reasoning.partition(THINK_START)
        reasoning = before + after if started else reasoning
        return reasoning, (content or None) if found else None


class ReasoningStream:
    """Splits a thinking request's streamed text into (reasoning, content) deltas that add up
    to :meth:`ReasoningParser.split` of the whole text. A tail that may be the start of a tag
    is held back until the next delta (or :meth:`finish`)."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self.started = False  # the one <think> that is dropped was seen
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        text, self.pending = self.pending + delta, ""
        end = text.find(THINK_END)
        head = text if end < 0 else text[:end]
        if not self.started and THINK_START in head:
            i = head.index(THINK_START)
            text = text[:i] + text[i + len(THINK_START):]
            self.started = True
            end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END):]
        keep = max(_partial_suffix(text, THINK_END), 0 if self.started else _partial_suffix(text, THINK_START))
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def finish(self) -> str:
        """The reasoning text still held back when the output ends."""
        rest, self.pending = self.pending, ""
        return rest if self.in_reasoning else ""
