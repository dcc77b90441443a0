"""Benchmark workloads: token-id prompts cut from real English text found on disk.

Prompts are windows of a token stream made by tokenizing text that ships with Python itself
(``pydoc_data.topics``: the language reference as plain text), topped up, if needed, with the
docstrings of stdlib modules. Nothing is downloaded. Every window starts at a different offset
of the stream, so two prompts never share a first KV block by accident (which would turn a
"random" workload into a prefix-cache one); ``prefix-repetition`` shares prefixes on purpose.

Datasets (names as in ``vllm bench``):
    random             lengths uniform in [min, max] (or ``len * (1 -/+ range_ratio)``)
    prefix-repetition  ``num_prefixes`` shared prefixes, each followed by distinct suffixes
    long-mix           a few long prompts shuffled among many short ones
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import random
import sysconfig
from dataclasses import dataclass
from typing import Optional, Sequence

DATASETS = ("random", "prefix-repetition", "long-mix")

# Default workload (W1 of the benchmark README): 32 prompts uniform in 64-512 tokens, 128 out.
DEFAULT_NUM_PROMPTS = 32
DEFAULT_MIN_INPUT_LEN = 64
DEFAULT_MAX_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 128


@dataclass
class SampleRequest:
    """One benchmark request: the prompt as token ids and as text, and how many tokens to make."""

    prompt_token_ids: list[int]
    prompt: str
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# -- the text ------------------------------------------------------------------------------
def _pydoc_topics() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k] for k in sorted(topics)]


def _stdlib_docstrings(max_chars: int) -> list[str]:
    """Module, class and function docstrings of the stdlib's .py files (sorted, deterministic)."""
    stdlib = sysconfig.get_paths().get("stdlib") or ""
    out: list[str] = []
    total = 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    out.append(doc)
                    total += len(doc)
        if total >= max_chars:
            break
    return out


def text_corpus_token_ids(tokenizer, min_tokens: int, max_tokens: int = 400_000) -> list[int]:
    """A stream of at least ``min_tokens`` token ids (at most ``max_tokens`` unless the text runs
    out, in which case it repeats) from real English text on disk."""
    ids: list[int] = []
    want = min(max(min_tokens, 8192), max_tokens)
    sources = [_pydoc_topics]
    for source in sources + [lambda: _stdlib_docstrings(4 * want)]:
        for text in source():
            ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
            if len(ids) >= want:
                break
        if len(ids) >= want:
            break
    if not ids:
        raise RuntimeError("found no text on disk to build prompts from (no pydoc_data, no stdlib sources)")
    while len(ids) < min_tokens:  # tiny corpus: repeat it
        ids = ids + ids
    return ids


class TextWindows:
    """Cuts token windows from the corpus, each at a fresh start offset."""

    def __init__(self, tokenizer, rng: random.Random, needed_tokens: int, num_windows: int) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.ids = text_corpus_token_ids(tokenizer, max(needed_tokens, num_windows + 1))
        self._used: set[int] = set()

    def take(self, length: int) -> list[int]:
        n = len(self.ids)
        for _ in range(64):
            start = self.rng.randrange(n)
            if start not in self._used:
                break
        self._used.add(start)
        out = self.ids[start : start + length]
        while len(out) < length:  # wrap around the end of the stream
            out.extend(self.ids[: length - len(out)])
        return out


# -- lengths -------------------------------------------------------------------------------
def length_range(length: Optional[int], range_ratio: float, lo: Optional[int], hi: Optional[int], default: tuple[int, int]) -> tuple[int, int]:
    """[min, max] of a length: explicit min/max win, then ``length * (1 -/+ range_ratio)`` as
    in vLLM's random dataset, then the default."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if length is not None:
        a, b = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    else:
        a, b = default
    if lo is not None:
        a = lo
    if hi is not None:
        b = hi
    if lo is not None and hi is None:  # one bound given: stretch the other to keep a valid range
        b = max(a, b)
    if hi is not None and lo is None:
        a = min(a, b)
    if a < 1 or b < a:
        raise ValueError(f"invalid length range [{a}, {b}]")
    return a, b


def _uniform_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


# -- datasets ------------------------------------------------------------------------------
def _make(tokenizer, ids: list[int], out_len: int) -> SampleRequest:
    return SampleRequest(ids, tokenizer.decode(ids), out_len)


def sample_random(tokenizer, num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    in_lens = _uniform_lengths(rng, num_prompts, *input_range)
    out_lens = _uniform_lengths(rng, num_prompts, *output_range)
    win = TextWindows(tokenizer, rng, 2 * max(in_lens) + num_prompts, num_prompts)
    return [_make(tokenizer, win.take(i), o) for i, o in zip(in_lens, out_lens)]


def sample_prefix_repetition(
    tokenizer, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_range: tuple[int, int], seed: int
) -> list[SampleRequest]:
    """``num_prefixes`` prefixes, each shared by ``num_prompts // num_prefixes`` prompts (the
    remainder spread over the first ones) with their own suffixes; shuffled."""
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 0:
        raise ValueError("prefix-repetition needs num_prefixes >= 1, prefix_len >= 1, suffix_len >= 0")
    rng = random.Random(seed)
    win = TextWindows(tokenizer, rng, 2 * (prefix_len + suffix_len) + num_prompts, num_prompts + num_prefixes)
    prefixes = [win.take(prefix_len) for _ in range(num_prefixes)]
    out: list[SampleRequest] = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + (win.take(suffix_len) if suffix_len else [])
        out.append(_make(tokenizer, ids, rng.randint(*output_range)))
    rng.shuffle(out)
    return out


def sample_long_mix(
    tokenizer, num_prompts: int, input_range: tuple[int, int], long_input_len: int, num_long: int, output_range: tuple[int, int], seed: int
) -> list[SampleRequest]:
    """``num_long`` prompts of ``long_input_len`` tokens shuffled among short ones whose lengths
    are uniform in ``input_range``."""
    num_long = max(0, min(num_long, num_prompts))
    rng = random.Random(seed)
    lens = [long_input_len] * num_long + _uniform_lengths(rng, num_prompts - num_long, *input_range)
    rng.shuffle(lens)
    win = TextWindows(tokenizer, rng, 2 * max(lens) + num_prompts, num_prompts)
    return [_make(tokenizer, win.take(n), rng.randint(*output_range)) for n in lens]


# -- command-line surface ------------------------------------------------------------------
def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random", choices=DATASETS)
    g.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="requests to send")
    g.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=None,
        help=f"prompt tokens (default: uniform in {DEFAULT_MIN_INPUT_LEN}-{DEFAULT_MAX_INPUT_LEN})",
    )
    g.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=None,
        help=f"output tokens per request (default {DEFAULT_OUTPUT_LEN}; EOS is ignored)",
    )
    g.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (vLLM's random dataset)",
    )
    g.add_argument("--min-input-len", type=int, default=None, help="shortest prompt (overrides --input-len/--range-ratio)")
    g.add_argument("--max-input-len", type=int, default=None, help="longest prompt")
    g.add_argument("--min-output-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=None)
    g.add_argument(
        "--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int, default=256, help="prefix-repetition: shared prefix tokens"
    )
    g.add_argument(
        "--suffix-len", "--prefix-repetition-suffix-len", dest="suffix_len", type=int, default=64, help="prefix-repetition: distinct suffix tokens"
    )
    g.add_argument(
        "--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes"
    )
    g.add_argument("--long-input-len", type=int, default=2048, help="long-mix: tokens of each long prompt")
    g.add_argument("--num-long", type=int, default=None, help="long-mix: how many long prompts (default: num_prompts // 16, at least 1)")


def output_range(args: argparse.Namespace) -> tuple[int, int]:
    return length_range(args.output_len, args.range_ratio, args.min_output_len, args.max_output_len, (DEFAULT_OUTPUT_LEN, DEFAULT_OUTPUT_LEN))


def input_range(args: argparse.Namespace) -> tuple[int, int]:
    return length_range(args.input_len, args.range_ratio, args.min_input_len, args.max_input_len, (DEFAULT_MIN_INPUT_LEN, DEFAULT_MAX_INPUT_LEN))


def build_requests(args: argparse.Namespace, tokenizer, seed: int) -> list[SampleRequest]:
    """The requests the dataset flags describe."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    out_r = output_range(args)
    if args.dataset_name == "random":
        return sample_random(tokenizer, args.num_prompts, input_range(args), out_r, seed)
    if args.dataset_name == "prefix-repetition":
        return sample_prefix_repetition(tokenizer, args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes, out_r, seed)
    if args.dataset_name == "long-mix":
        num_long = args.num_long if args.num_long is not None else max(1, args.num_prompts // 16)
        return sample_long_mix(tokenizer, args.num_prompts, input_range(args), args.long_input_len, num_long, out_r, seed)
    raise ValueError(f"unknown dataset {args.dataset_name!r}")


def describe(requests: Sequence[SampleRequest]) -> str:
    ins = [r.prompt_len for r in requests]
    outs = [r.expected_output_len for r in requests]
    return (
        f"{len(requests)} requests, prompt tokens {min(ins)}-{max(ins)} (mean {sum(ins) / len(ins):.0f}, total {sum(ins)}), "
        f"output tokens {min(outs)}-{max(outs)} (total {sum(outs)})"
    )
