"""Incremental detokenization with stop strings.

The design follows vLLM v1's frontend detokenizer (``vllm/v1/engine/detokenizer.py``): each
request owns an :class:`IncrementalDetokenizer` that turns newly sampled token ids into text,
checks the stop strings against the newly added text only, and decides how much text may be
streamed to the client now (text that could still turn out to be the start of a stop string is
held back).

Turning ids into text one token at a time is not ``decode(id)`` per token: byte-level BPE splits
one UTF-8 character (CJK, emoji) over several tokens, and SentencePiece / Metaspace decoders drop
or keep the leading space of a word depending on its left context. The two decoders of
:mod:`pagedserve.engine.token_decoders` handle this.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedserve.engine.token_decoders import (  # noqa: F401  (re-exported for tests and callers)
    OffsetTokenDecoder,
    StreamTokenDecoder,
    TokenDecoder,
    _DecodeStream,
    get_backend_tokenizer,
)
from pagedserve.sampling_params import SamplingParams


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str], include_in_output: bool) -> Optional[tuple[str, int]]:
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
        self.num_token_ids_dropped = 0  # ids of the matching update after the stop string
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
        ``include_stop_str_in_output``), dropping any text after it, and the ids after the one
        that completed it are not kept (``num_token_ids_dropped`` says how many of
        ``new_token_ids`` were left out). Updates after a match add the ids but no text.
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

        # Decode the new ids one at a time and check the stop strings in each one's text, so
        # that when several arrive at once (speculative decoding) the ids end at the one that
        # completed a stop string, as they do one token at a time.
        for n, tid in enumerate(new_token_ids, start=1):
            stop_check_offset = len(self._output_text)
            self.token_ids.append(tid)
            self._output_text += self.decoder.decode_next(tid)
            if not self.stop or len(self.token_ids) <= self.min_tokens:
                continue  # stop strings do not count within the first min_tokens tokens
            match = check_stop_strings(self._output_text, len(self._output_text) - stop_check_offset, self.stop, self.include_stop_str_in_output)
            if match is not None:
                self.num_token_ids_dropped = len(new_token_ids) - n + (skipped_stop_token is not None)
                self.stop_string, truncate_to = match
                self._output_text = self._output_text[:truncate_to]
                return self.stop_string
        if skipped_stop_token is not None:
            self.token_ids.append(skipped_stop_token)
        return None

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
