"""Structured output: grammars that constrain what a request may generate, enforced with a
token bitmask per constrained request per step (vLLM v1's ``StructuredOutputManager`` design).

The grammar library is llguidance (Microsoft's guidance backend, Rust, no dependencies): JSON
schemas, regular expressions and Lark-style context-free grammars, compiled against the
model's tokenizer. Measured on this project's 2-core CPU with SmolLM2's 49,152-token vocabulary
(docs/perf-history.md, "Issue 13: structured output"): a schema compiles in 1-2 ms and a mask takes 13-26 us (median) per
token; xgrammar's masks are faster (1-2 us) but it depends on torch and triton, and both costs
are under 0.1 % of a decode step.

Per request: a matcher is made when the request is added (from a cache of compiled grammars,
keyed by the constraint), the scheduler asks for the bitmask of every constrained request that
samples in a step and sends it with the ``SchedulerOutput``, the worker masks those logits rows,
and each sampled token advances the matcher; a matcher that reaches the end of its grammar
finishes the request ("stop"). JSON grammars use fixed separators (``", "`` and ``": "``) and no
optional whitespace between tokens, so a sampled answer cannot run away in spaces and newlines,
and objects admit only the properties the schema names unless it says otherwise (as vLLM's
default xgrammar backend in strict mode). A regex that ends in a lone backslash is refused here:
llguidance would drop the backslash.
Torch-free; llguidance is imported on first use.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import numpy as np

from pagedserve.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256
# A grammar whose mask takes longer than this for one token fails its request instead of
# holding up every other request of the step (a normal mask takes 0.01-1.3 ms here).
MASK_BUDGET_S = 0.1
# llguidance's JSON layout: no optional whitespace (llguidance's default allows any amount
# between tokens, and a small model then emits runs of newlines), one space after ":" and ",".
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def close_objects(schema: Any) -> None:
    """In place: an object schema with ``properties`` and no ``additionalProperties`` gets
    ``additionalProperties: false`` (xgrammar's strict mode, vLLM's default): without it a small
    model pads a JSON answer with invented keys until max_tokens. Only schemas that stand alone
    are closed: not one combined with ``allOf``, ``$ref`` or conditionals (closing each part of
    an ``allOf`` would make it unsatisfiable), and nothing under those."""
    if isinstance(schema, list):
        for s in schema:
            close_objects(s)
        return
    if not isinstance(schema, dict):
        return
    combined = any(k in schema for k in ("allOf", "$ref", "if", "then", "else", "dependentSchemas", "unevaluatedProperties"))
    if "properties" in schema and "additionalProperties" not in schema and not combined:
        schema["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                close_objects(sub)
    for key in ("items", "additionalProperties", "anyOf", "oneOf", "prefixItems"):
        close_objects(schema.get(key))


# JSON schema keywords whose values are subschemas: a map of them, or one (or a list of them).
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
)


def check_regex(rx: str, name: str) -> None:
    """Raises ValueError when ``rx`` ends in a lone backslash: an incomplete escape, invalid in
    every regex syntax, which llguidance's regex-to-Lark step drops silently (``ab\\`` would
    mean ``ab``). Its Rust parser reports every other invalid pattern itself."""
    if (len(rx) - len(rx.rstrip("\\"))) % 2:
        end = repr(rx) if len(rx) <= 40 else f"...{rx[-40:]!r}"
        raise ValueError(
            f"{name} is invalid: regex parse error: incomplete escape sequence at the end of {end} "
            "(a lone trailing backslash; a literal backslash is written \\\\)."
        )


def check_schema_regexes(schema: Any, name: str, where: str = "") -> None:
    """``check_regex`` on every regex of a JSON schema: ``pattern``, ``patternProperties`` keys
    and llguidance's ``x-guidance.whitespace_pattern``."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            check_schema_regexes(s, name, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("pattern"), str):
        check_regex(schema["pattern"], f"{name} (at {where}/pattern)")
    guidance = schema.get("x-guidance")
    if isinstance(guidance, dict) and isinstance(guidance.get("whitespace_pattern"), str):
        check_regex(guidance["whitespace_pattern"], f"{name} (at {where}/x-guidance/whitespace_pattern)")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for k, sub in schema[key].items():
                if key == "patternProperties":
                    check_regex(k, f"{name} (at {where}/patternProperties)")
                check_schema_regexes(sub, name, f"{where}/{key}/{k}")
    for key in _SUBSCHEMAS:
        check_schema_regexes(schema.get(key), name, f"{where}/{key}")


def check_grammar_regexes(grammar: str) -> None:
    """``check_schema_regexes`` on the JSON schemas a Lark grammar embeds (``%json {...}``)."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"%json\s*", grammar):
        try:
            schema, _ = decoder.raw_decode(grammar, m.end())
        except ValueError:
            continue  # not JSON: llguidance refuses it
        check_schema_regexes(schema, "structured_outputs.grammar")


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of one constraint.

    Raises:
        ValueError: the JSON schema is not JSON, a regex (alone, in a schema or in a grammar's
            ``%json``) ends in a lone backslash, or a GBNF grammar cannot be converted (other
            errors show when the grammar is compiled, see ``validate``).
    """
    import llguidance

    kind = so.kind
    if kind in ("json", "json_object"):
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            try:
                schema = json.loads(so.json)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema (an object)")
                check_schema_regexes(schema, "structured_outputs.json")
                close_objects(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("structured_outputs.json is nested too deeply") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_LAYOUT}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if kind == "regex":
        check_regex(so.regex, "structured_outputs.regex")
        return llguidance.grammar_from("regex", so.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    try:  # Lark syntax (llguidance's), or GBNF (llama.cpp's), which llguidance converts
        check_grammar_regexes(so.grammar)
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        if str(e).startswith("structured_outputs.grammar"):  # check_grammar_regexes
            raise
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None
    except Exception as e:  # the GBNF converter raises its own error types
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None


class StructuredOutputManager:
    """Grammar compilation and per-request matchers for one model.

    Args:
        tokenizer_loader: returns the model's transformers tokenizer (called on first use:
            building llguidance's tokenizer takes ~0.3 s).
        vocab_size: width of the logits (may exceed the tokenizer's vocabulary).
        eos_loader: the model's EOS ids (its generation config's) from the tokenizer; a
            grammar may end with any of them. None: the tokenizer's own EOS.
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], vocab_size: int, eos_loader: Optional[Callable[[Any], Any]] = None) -> None:
        self._tokenizer_loader = tokenizer_loader
        self._eos_loader = eos_loader
        self.vocab_size = vocab_size
        self._lltokenizer = None
        self._lock = threading.Lock()  # the frontend validates from worker threads
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._limits = None

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance
                import llguidance.hf

                tok = self._tokenizer_loader()
                eos = sorted(self._eos_loader(tok)) if self._eos_loader is not None else None
                self._lltokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab_size, eos_token=eos or None)
                # Earley items per mask step: llguidance's default (50,000) lets an ambiguous
                # 37-character grammar take 0.7-1.4 s per token; 10,000 errs within ~60 ms.
                self._limits = llguidance.LLParserLimits(step_max_items=10_000)
            return self._lltokenizer

    def validate(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError with llguidance's message when the constraint cannot be compiled."""
        import llguidance

        spec = grammar_spec(so)
        tok = self.lltokenizer
        err = llguidance.LLMatcher.validate_grammar(spec, tok, limits=self._limits)
        if err:
            raise ValueError(f"structured_outputs.{so.kind} is invalid: {err}")

    def new_matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher at the start of the grammar (compiled grammars are cached).

        Raises:
            ValueError: the constraint does not compile.
        """
        import llguidance

        spec = grammar_spec(so)
        tok = self.lltokenizer
        with self._lock:
            proto = self._compiled.get(spec)
            if proto is not None:
                self._compiled.move_to_end(spec)
        if proto is None:
            proto = llguidance.LLMatcher(tok, spec, log_level=0, limits=self._limits)
            if proto.is_error():
                raise ValueError(f"structured_outputs.{so.kind} is invalid: {proto.get_error()}")
            with self._lock:
                self._compiled[spec] = proto
                if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return proto.deep_copy()

    def grammar_bitmask(self, matchers: list[Any], drafts: Optional[list[list[int]]] = None) -> tuple[bytes, list[int]]:
        """``[R, ceil(vocab_size / 32)]`` int32 (little-endian bytes): bit t of a row is set when
        token t may come next. Matcher i has ``1 + len(drafts[i])`` consecutive rows (speculative
        decoding: row j after its draft tokens ``0 .. j-1``, taken by a copy of the matcher; they
        must come from :meth:`valid_draft_prefix`), one row without drafts. Also returns the
        matchers (indices) whose masks took longer than ``MASK_BUDGET_S`` per row (their requests
        must be failed)."""
        import llguidance.numpy as lln

        drafts = drafts or [[] for _ in matchers]
        mask = lln.allocate_token_bitmask(sum(1 + len(d) for d in drafts), self.vocab_size)
        slow, row = [], 0
        for i, (m, ds) in enumerate(zip(matchers, drafts)):
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask(m, mask, row)
            probe = m.deep_copy() if ds else None  # ~1 us; the request's own matcher is not touched
            for j, t in enumerate(ds, start=1):
                probe.consume_token(t)
                lln.fill_next_token_bitmask(probe, mask, row + j)
            row += 1 + len(ds)
            if time.perf_counter() - t0 > MASK_BUDGET_S * (1 + len(ds)):
                slow.append(i)
        return np.ascontiguousarray(mask, dtype="<i4").tobytes(), slow

    @staticmethod
    def valid_draft_prefix(matcher: Any, tokens: list[int]) -> int:
        """How many leading ``tokens`` may be drafts under the grammar from its current state:
        those it accepts, ending at the one that completes it (nothing after, not even EOS).
        ``matcher`` is not changed."""
        n = int(matcher.validate_tokens(tokens)) if tokens else 0
        if n == 0:
            return 0
        probe = matcher.deep_copy()
        for i, t in enumerate(tokens[:n]):
            probe.consume_token(t)
            if probe.is_error():
                return i
            if probe.is_stopped():
                return i + 1
        return n

    @staticmethod
    def accept_token(matcher: Any, token_id: int) -> Optional[str]:
        """Advance ``matcher`` by a sampled token. Returns None while the grammar goes on,
        "done" when it is complete, or llguidance's error message when it failed (a resource
        limit, or a token the mask forbade: every token was masked)."""
        matcher.consume_token(token_id)
        if matcher.is_error():
            return matcher.get_error() or "the grammar could not accept the sampled token"
        return "done" if matcher.is_stopped() else None
