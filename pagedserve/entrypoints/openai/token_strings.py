"""The text and UTF-8 bytes of single tokens, for logprobs (``bytes`` in chat logprobs): byte-level
BPE vocabularies store bytes as printable stand-ins (GPT-2's table), SentencePiece ones as
``<0xNN>``; anything else is decoded. :class:`TokenPieces`: each token's share of a text, for
completions logprobs (``tokens`` that join to the text, ``text_offset`` into it)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Optional

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenStrings:
    """Per-token text and UTF-8 bytes for logprobs, cached by token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        raw = self._bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> bytes:
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if raw is None:
            return b""
        m = _BYTE_FALLBACK.match(raw)
        if m:
            return bytes([int(m.group(1), 16)])
        if raw and all(c in _BYTE_DECODER for c in raw) and not (raw.startswith("<") and raw.endswith(">")):
            return bytes(_BYTE_DECODER[c] for c in raw)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


class TokenPieces:
    """Each token's share of a text: the pieces join to the text, and a character split over
    several tokens goes to the token that completes it (the pieces before it are ""). Tokens are
    decoded as the engine's detokenizer decodes them (``prompt_token_ids`` the left context,
    ``params`` its special-token options), then checked against the text the client got: a
    piece that is not there (a stop token the text leaves out, a text cut at a stop string) is
    cut to what is, and text no piece covered goes to the last token once the text is final."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.decoder = IncrementalDetokenizer(tokenizer, prompt_token_ids, params).decoder
        self.text = ""  # the text so far
        self.pos = 0  # how much of it the pieces so far cover

    def feed(self, token_ids: list[int], text: str, final: bool) -> list[str]:
        """The pieces of ``token_ids``, which came with ``text`` (held-back text may come later);
        ``final``: no text comes after ``text``."""
        self.text += text
        out = []
        for tid in token_ids:
            piece = self.decoder.decode_next(tid) if self.decoder is not None else ""
            if final or self.pos + len(piece) <= len(self.text):
                k = 0
                while k < len(piece) and self.pos + k < len(self.text) and piece[k] == self.text[self.pos + k]:
                    k += 1
                piece = piece[:k]
            # else: past the text known so far (held back for a stop string): taken as decoded
            out.append(piece)
            self.pos += len(piece)
        if final and out and self.pos < len(self.text):
            out[-1] += self.text[self.pos :]
            self.pos = len(self.text)
        return out

    @classmethod
    def of_prompt(cls, tokenizer: Any, prompt_token_ids: list[int], text: str) -> list[str]:
        """The pieces of an echoed prompt whose text is ``text``."""
        return cls(tokenizer, [], SamplingParams(skip_special_tokens=False)).feed(prompt_token_ids, text, final=True)


def finite_logprob(x: float) -> float:
    """A logprob JSON can carry: -inf and NaN become -9999.0 (as vLLM and OpenAI)."""
    return max(x, -9999.0) if x == x else -9999.0


def prompt_logprobs_json(tokens: TokenStrings, entries: Optional[list]) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` of a response: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} (``RequestOutput.prompt_logprobs`` entries)."""
    if entries is None:
        return None
    return [
        None if e is None else {t: {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": tokens.text(t)} for t, lp in e.items()}
        for e in entries
    ]
