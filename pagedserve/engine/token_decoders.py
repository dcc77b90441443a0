"""Token-by-token text for incremental detokenization: two decoders that never emit a partial
UTF-8 character and keep the tokenizer's spacing (see :mod:`pagedserve.engine.detokenizer`).

* :class:`StreamTokenDecoder` (preferred, fast tokenizers): the ``tokenizers`` library's
  ``tokenizers.decoders.DecodeStream``, which re-decodes a small sliding window of ids, emits the
  text past the window's prefix, and returns ``None`` while the window ends in an incomplete
  UTF-8 sequence.
* :class:`OffsetTokenDecoder` (fallback: slow tokenizers, or ``tokenizers`` without
  ``DecodeStream``): the prefix-offset / read-offset algorithm of vLLM's
  ``detokenize_incrementally`` (originally from Hugging Face text-generation-inference).

Both are primed with the last few prompt tokens, so the first output token is spaced as if
decoded after the prompt.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

try:  # DecodeStream appeared in tokenizers 0.21.
    import tokenizers as _tokenizers
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - depends on the installed tokenizers
    _tokenizers = None
    _DecodeStream = None

# Error raised by DecodeStream when a window's decoded text no longer starts with its prefix
# (non-monotonic decoders); vLLM resets the stream on it (vllm-project/vllm#17448).
_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"

# Prompt context used to prime a decoder: the shortest suffix of at least this many prompt tokens
# that decodes without U+FFFD, looking back at most _MAX_PROMPT_CONTEXT tokens (as vLLM v1).
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24

# Prompt tokens kept as left context by the offset algorithm (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), plus a little slack for special tokens.
_INITIAL_OFFSET = 5


class TokenDecoder(Protocol):
    def decode_next(self, token_id: int) -> str:
        """Text that token ``token_id`` completes ("" if it completes nothing yet)."""


def get_backend_tokenizer(tokenizer: Any) -> Optional[Any]:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, or None (slow ones)."""
    if _tokenizers is None:
        return None
    if isinstance(tokenizer, _tokenizers.Tokenizer):
        return tokenizer
    for attr in ("_tokenizer", "backend_tokenizer"):
        try:
            backend = getattr(tokenizer, attr, None)
        except Exception:  # some slow tokenizers raise from backend_tokenizer
            backend = None
        if isinstance(backend, _tokenizers.Tokenizer):
            return backend
    return None


def _prompt_context(prompt_token_ids: list[int], decode) -> list[int]:
    """A suffix of the prompt to prime a decoder with (after vLLM v1 FastIncrementalDetokenizer).

    The shortest suffix of >= 4 tokens (up to 24) whose text has no U+FFFD, i.e. that neither
    starts nor ends inside a multi-byte character; failing that, the longest such shorter suffix;
    failing that (the prompt ends in an incomplete or unencodable character), no context. A
    context whose text is still pending would otherwise leak prompt text into the first output.
    """
    n = len(prompt_token_ids)

    def clean(i: int) -> bool:
        try:
            return "\ufffd" not in decode(prompt_token_ids[n - i :])
        except Exception:  # out-of-vocab prompt ids
            return False

    lo = min(_MIN_PROMPT_CONTEXT, n)
    for i in list(range(lo, min(n, _MAX_PROMPT_CONTEXT) + 1)) + list(range(lo - 1, 0, -1)):
        if clean(i):
            return list(prompt_token_ids[n - i :])
    return []


class StreamTokenDecoder:
    """Token-by-token decoding with ``tokenizers.decoders.DecodeStream``.

    Primed by stepping the prompt context through the stream (its text is discarded). With
    ``skip_special_tokens=False`` and ``spaces_between_special_tokens=False``, an added token that
    directly follows another added token is returned as its raw content (no separating space),
    as vLLM v1 does.
    """

    def __init__(self, backend: Any, prompt_token_ids: list[int], params: SamplingParams):
        if _DecodeStream is None:  # pragma: no cover
            raise RuntimeError("tokenizers.decoders.DecodeStream is unavailable")
        self.tokenizer = backend
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)

        context = _prompt_context(
            prompt_token_ids,
            lambda ids: backend.decode(ids, skip_special_tokens=self.skip_special_tokens),
        )
        for tid in context:
            self._step(tid)

        self.spaces_between_special_tokens = params.skip_special_tokens or params.spaces_between_special_tokens
        self.added_tokens: dict[int, str] = {}
        self.last_added = False
        if not self.spaces_between_special_tokens:
            self.added_tokens = {tid: t.content for tid, t in backend.get_added_tokens_decoder().items()}
            if not self.added_tokens:
                self.spaces_between_special_tokens = True

    def _step(self, token_id: int) -> Optional[str]:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            logger.warning("Cannot detokenize invalid token id %r", token_id)
            return None
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            # The decoder produced text that does not extend its prefix: restart the stream
            # without context (vllm-project/vllm#17448).
            logger.warning("DecodeStream invalid prefix; resetting the decode stream")
            self.stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.tokenizer, token_id)

    def decode_next(self, token_id: int) -> str:
        text = self._step(token_id)
        if not self.spaces_between_special_tokens:
            content = self.added_tokens.get(token_id)
            is_added = content is not None
            if is_added and self.last_added:
                text = content
            self.last_added = is_added
        return text or ""


class OffsetTokenDecoder:
    """Token-by-token decoding by the prefix-offset / read-offset algorithm.

    As vLLM's ``detokenize_incrementally``: ``tokens`` holds token strings (the last few prompt
    tokens, then the output tokens). ``tokens[prefix_offset:read_offset]`` is text already
    returned; the new text is ``convert_tokens_to_string(tokens[prefix_offset:])`` past the text of
    that prefix. It is returned (and both offsets advance) only if it grew and does not end in
    U+FFFD (an incomplete UTF-8 sequence from byte tokens); otherwise the tokens wait for more.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        try:
            self.vocab_size = len(tokenizer)
        except TypeError:
            self.vocab_size = None
        try:
            added = tokenizer.get_added_vocab()
        except Exception:
            added = {}
        # Fast tokenizers join added tokens themselves; slow ones need help (as vLLM).
        self.added_vocab = {} if getattr(tokenizer, "is_fast", False) else dict(added)
        self.all_special_tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])

        context = prompt_token_ids[-(_INITIAL_OFFSET + 2) :]
        self.tokens: list[str] = self._to_tokens(context)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _INITIAL_OFFSET, 0)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        ids = [i for i in ids if self.vocab_size is None or 0 <= i < self.vocab_size]
        if not ids:
            return []
        toks = self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=self.skip_special_tokens)
        if isinstance(toks, str):
            toks = [toks]
        return [t if t is not None else "" for t in toks]

    def _to_string(self, tokens: list[str]) -> str:
        if not self.added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizers: convert runs of ordinary tokens, keep added tokens verbatim.
        parts: list[str] = []
        run: list[str] = []
        for t in tokens:
            if self.skip_special_tokens and t in self.all_special_tokens:
                continue
            if t in self.added_vocab:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(t)
            else:
                run.append(t)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(parts)

    def decode_next(self, token_id: int) -> str:
        self.tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]
