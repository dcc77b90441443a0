"""Reasoning outputs (vLLM's ``--reasoning-parser``): a thinking model's text inside its
``<think>`` block is returned as the chat message's ``reasoning_content`` (and ``reasoning``,
vLLM's newer name), the rest as ``content``. Where the output starts (:meth:`ReasoningParser.thinking`):

- the prompt ends in an open thinking block (``<think>`` after the last ``</think>``): in
  reasoning, with both parsers;
- the prompt closed its block (``</think>`` last, as templates do when thinking is switched
  off), or ``qwen3`` with ``chat_template_kwargs: {"enable_thinking": false}``: all content;
- no tag in the prompt: ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, whose templates may
  put ``<think>`` in the prompt) starts in reasoning; ``qwen3`` is in reasoning only if the
  output starts with ``<think>``, else all of it is content, finished or cut by max_tokens
  (vLLM's qwen3 rule; a stream follows it without holding text back).

In reasoning, the text runs until ``</think>``, the first ``<think>`` is dropped, and without
``</think>`` (cut by max_tokens) everything is reasoning. The engine leaves a request whose
output starts in reasoning unconstrained (structured output, forced tool calls) until it has
generated ``</think>`` (see ``pagedserve.core.sched.scheduler.check_stop``), as vLLM; any other request (a
``qwen3`` one with no ``<think>`` in its prompt too) is constrained from its first token. Both
tags must be single tokens of the model's vocabulary.
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
                raise ValueError(
                    f"--reasoning-parser {name}: the model's tokenizer has no single {tag} token "
                    f"(it reads as {len(got)} tokens); this model does not think in {THINK_START} blocks"
                )
            ids.append(got[0])
        return cls(name, ids[0], ids[1])

    def thinking(self, prompt_token_ids: list[int], chat_template_kwargs: Optional[dict] = None) -> Optional[bool]:
        """Where the output of this prompt starts: True in reasoning, False in content, None
        (``qwen3``, no tag in the prompt) in reasoning only if it starts with ``<think>``."""
        if self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
            return False
        for t in reversed(prompt_token_ids):
            if t == self.end_id:
                return False
            if t == self.start_id:
                return True
        return True if self.name == "deepseek_r1" else None

    def thinks(self, prompt_token_ids: list[int], chat_template_kwargs: Optional[dict] = None) -> bool:
        """Whether the output surely starts in reasoning (its constraints wait for ``</think>``)."""
        return self.thinking(prompt_token_ids, chat_template_kwargs) is True

    def reasoning_tokens(self, token_ids: list[int], thinking: Optional[bool]) -> int:
        """Output tokens spent thinking: up to and with ``</think>`` (all of them if it never came)."""
        if thinking is None:
            thinking = bool(token_ids) and token_ids[0] == self.start_id
        if not thinking:
            return 0
        return token_ids.index(self.end_id) + 1 if self.end_id in token_ids else len(token_ids)

    @staticmethod
    def split(text: str, thinking: Optional[bool] = True) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output that starts as :meth:`thinking` says; None for
        an empty part that has no tag (content after ``</think>`` is None when nothing follows it)."""
        if thinking is None:
            thinking = text.startswith(THINK_START)
        if not thinking:
            return None, text
        reasoning, found, content = text.partition(THINK_END)
        before, started, after = reasoning.partition(THINK_START)
        reasoning = before + after if started else reasoning
        return reasoning, (content or None) if found else None


class ReasoningStream:
    """Splits a streamed output into (reasoning, content) deltas that add up to
    :meth:`ReasoningParser.split` of the whole text. A tail that may be the start of a tag is
    held back until the next delta (or :meth:`finish`)."""

    def __init__(self, thinking: Optional[bool]) -> None:
        self.undecided = thinking is None  # qwen3: reasoning only if the output starts with <think>
        self.in_reasoning = bool(thinking)
        self.started = False  # the one <think> that is dropped was seen
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if self.undecided:
            delta, self.pending = self.pending + delta, ""
            if len(delta) < len(THINK_START) and THINK_START.startswith(delta):
                self.pending = delta
                return "", ""
            self.undecided, self.in_reasoning = False, delta.startswith(THINK_START)
        if not self.in_reasoning:
            return "", delta
        text, self.pending = self.pending + delta, ""
        end = text.find(THINK_END)
        head = text if end < 0 else text[:end]
        if not self.started and THINK_START in head:
            i = head.index(THINK_START)
            text = text[:i] + text[i + len(THINK_START) :]
            self.started = True
            end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END) :]
        keep = max(_partial_suffix(text, THINK_END), 0 if self.started else _partial_suffix(text, THINK_START))
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) still held back when the output ends."""
        rest, self.pending = self.pending, ""
        if self.undecided:
            return "", rest
        return (rest, "") if self.in_reasoning else ("", "")
