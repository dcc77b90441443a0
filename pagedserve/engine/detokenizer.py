"""Incremental detokenization with stop strings.

The design follows vLLM v1's frontend detokenizer (``vllm/v1/engine/detokenizer.py``): each
request owns an :class:`IncrementalDetokenizer` that turns newly sampled token ids into text,
checks the stop strings against the newly added text only, and decides how much text may be
streamed to the client now (text that could still turn out to be the start of a stop string is
held back).

Turning ids into text one token at a time is not ``decode(id)`` per token: byte-level BPE splits
one UTF-8 character (CJK, emoji) over several tokens, and SentencePiece / Metaspace decoders drop
or keep the leading space of a word depending on its left context. Two decoders handle this:

* :class:`StreamTokenDecoder` (preferred, fast tokenizers): the ``tokenizers`` library's
  ``tokenizers.decoders.DecodeStream``, which re-decodes a small sliding window of ids, emits the
  text past the window's prefix, and returns ``None`` while the window ends in an incomplete
  UTF-8 sequence.
* :class:`OffsetTokenDecoder` (fallback: slow tokenizers, or ``tokenizers`` without
  ``DecodeStream``): the prefix-offset / read-offset algorithm of vLLM's
  ``detokenize_incrementally`` (originally from Hugging Face text-generation-inference):
  ``convert_tokens_to_string`` over ``tokens[prefix_offset:]`` minus the text of
  ``tokens[prefix_offset:read_offset]``, emitted only when it grew and does not end in U+FFFD.

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

        context = prompt_token_ids[-(_INITIAL_OFFSET + 2):]
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


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> Optional[tuple[str, int]]:
    """Find a stop string in the last ``new_char_count`` characters of ``output_text``.

    Each stop string ``s`` is searched only where it could newly end: from
    ``len(output_text) - new_char_count - len(s) + 1`` on, so text searched before is not
    searched again, yet matches spanning the old/new boundary (and token boundaries) are found.
    The earliest match wins (smallest start; on a tie, the shorter string, which ends first).

    Returns ``(stop_string, truncate_to)``: the text should be cut to ``output_text[:truncate_to]``,
    which is before the stop string, or after it when ``include_in_output``. None: no match.
    """
    if new_char_count <= 0 or not stop:
        return None
    n = len(output_text)
    best: Optional[tuple[int, int, str]] = None
    for s in stop:
        start = max(0, n - new_char_count - len(s) + 1)
        idx = output_text.find(s, start)
        if idx == -1:
            continue
        key = (idx, idx + len(s), s)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    idx, end, s = best
    return s, (end if include_in_output else idx)


class IncrementalDetokenizer:
    """Per-request incremental detokenizer with stop strings (after vLLM v1's detokenizer).

    ``update()`` appends sampled ids, decodes them with a :class:`StreamTokenDecoder`
    (``tokenizers`` ``DecodeStream``) or, failing that, an :class:`OffsetTokenDecoder`, then checks
    the stop strings against the new text (see :func:`check_stop_strings`). On a match the text is
    truncated and the matched string returned; the engine then finishes the request.

    ``get_next_output_text()`` decides what to stream: while the request runs, the last
    ``max(len(s) for s in stop) - 1`` characters are held back (unless
    ``include_stop_str_in_output``), since they may be the start of a stop string that must never
    reach the client; once finished, everything is released.

    Stop strings are not checked within the first ``min_tokens`` output tokens (as vLLM). With
    ``params.detokenize == False`` nothing is decoded: ``output_text`` stays "" and no stop string
    can match.

    Args:
        tokenizer: a transformers tokenizer (fast: its ``tokenizers.Tokenizer`` is used with
            ``DecodeStream``; slow: the offset algorithm), or a ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt, whose last few tokens give the left context for spacing.
        params: ``skip_special_tokens``, ``spaces_between_special_tokens``, ``stop``,
            ``include_stop_str_in_output``, ``min_tokens`` and ``detokenize`` are used.
        use_decode_stream: force (True) or forbid (False) ``DecodeStream``; None picks it when
            available.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        use_decode_stream: Optional[bool] = None,
    ):
        self.token_ids: list[int] = []  # output token ids, including a final stop token
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.detokenize = params.detokenize
        # Characters held back from streaming while the request runs.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        self.stop_string: Optional[str] = None  # the stop string that matched, once one did
        self._output_text = ""
        self._last_output_text_offset = 0

        self.decoder: Optional[TokenDecoder] = None
        if self.detokenize:
            backend = get_backend_tokenizer(tokenizer)
            stream_ok = backend is not None and _DecodeStream is not None
            if use_decode_stream and not stream_ok:
                raise ValueError("DecodeStream needs a fast tokenizer and tokenizers>=0.21")
            if stream_ok and use_decode_stream is not False:
                self.decoder = StreamTokenDecoder(backend, prompt_token_ids, params)
            else:
                self.decoder = OffsetTokenDecoder(tokenizer, prompt_token_ids, params)

    @property
    def output_text(self) -> str:
        """All text decoded so far, without the stop string (unless include_stop_str_in_output)."""
        return self._output_text

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        """Append newly sampled tokens; return the stop string that matched, if any.

        ``stop_terminated``: the last id is an EOS / stop token id that ends the request. Its text
        is not decoded (as vLLM, unless ``include_stop_str_in_output``).

        On a match, ``output_text`` is cut before the stop string (after it with
        ``include_stop_str_in_output``), dropping any text after it. Updates after a match add
        the ids but no text.
        """
        if not new_token_ids:
            return None
        new_token_ids = list(new_token_ids)
        skipped_stop_token: Optional[int] = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids.pop()

        if self.decoder is None or self.stop_string is not None:
            self.token_ids.extend(new_token_ids)
            if skipped_stop_token is not None:
                self.token_ids.append(skipped_stop_token)
            return None

        # 1) Decode the new ids.
        stop_check_offset = len(self._output_text)
        for tid in new_token_ids:
            self.token_ids.append(tid)
            self._output_text += self.decoder.decode_next(tid)
            if self.min_tokens and len(self.token_ids) <= self.min_tokens:
                # Stop strings do not count within the first min_tokens tokens.
                stop_check_offset = len(self._output_text)
        if skipped_stop_token is not None:
            self.token_ids.append(skipped_stop_token)

        # 2) Check stop strings in the new text.
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(
            self._output_text,
            len(self._output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_string, truncate_to = match
        self._output_text = self._output_text[:truncate_to]
        self.stop_string = stop_string
        return stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now.

        While not ``finished``, the last ``stop_buffer_length`` characters are held back. With
        ``delta``, only the text no earlier delta call returned; otherwise all text up to the
        emit point.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self._output_text) - buffer_length, 0)
        if not delta:
            return self._output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self._output_text[last:length]
        return ""
