"""Structured output: grammars that constrain what a request may generate, enforced with a
token bitmask per constrained request per step (vLLM v1's ``StructuredOutputManager`` design).

The grammar library is llguidance (Microsoft's guidance backend, Rust, no dependencies): JSON
schemas, regular expressions and Lark-style context-free grammars, compiled against the
model's tokenizer. Measured on this project's 2-core CPU with SmolLM2's 49,152-token vocabulary
(benchmarks/README.md): a schema compiles in 1-2 ms and a mask takes 13-26 us (median) per
token; xgrammar's masks are faster (1-2 us) but it depends on torch and triton, and both costs
are under 0.1 % of a decode step.

Per request: a matcher is made when the request is added (from a cache of compiled grammars,
keyed by the constraint), the scheduler asks for the bitmask of every constrained request that
samples in a step and sends it with the ``SchedulerOutput``, the worker masks those logits rows,
and each sampled token advances the matcher; a matcher that reaches the end of its grammar
finishes the request ("stop"). JSON grammars use fixed separators (``", "`` and ``": "``) and no
optional whitespace between tokens, so a sampled answer cannot run away in spaces and newlines,
and objects admit only the properties the schema names unless it says otherwise (as vLLM's
default xgrammar backend in strict mode).
Torch-free; llguidance is imported on first use.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from pagedserve.sampling_params import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256
# llguidance's JSON layout: no optional whitespace (llguidance's default allows any amount
# between tokens, and a small model then emits runs of newlines), one space after ":" and ",".
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def close_objects(schema: Any) -> None:
    """In place: an object schema with ``properties`` and no ``additionalProperties`` gets
    ``additionalProperties: false``, at every depth (xgrammar's strict mode, vLLM's default):
    without it a small model pads a JSON answer with invented keys until max_tokens."""
    if isinstance(schema, list):
        for s in schema:
            close_objects(s)
        return
    if not isinstance(schema, dict):
        return
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                close_objects(sub)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        close_objects(schema.get(key))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        close_objects(schema.get(key))


def grammar_spec(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of one constraint.

    Raises:
        ValueError: the JSON schema is not JSON, or a GBNF grammar cannot be converted (other
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
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            close_objects(schema)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_LAYOUT}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if kind == "regex":
        return llguidance.grammar_from("regex", so.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    try:  # Lark syntax (llguidance's), or GBNF (llama.cpp's), which llguidance converts
        return llguidance.grammar_from("grammar", so.grammar)
    except Exception as e:  # the GBNF converter raises its own error types
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None


class StructuredOutputManager:
    """Grammar compilation and per-request matchers for one model.

    Args:
        tokenizer_loader: returns the model's transformers tokenizer (called on first use:
            building llguidance's tokenizer takes ~0.3 s).
        vocab_size: width of the logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], vocab_size: int) -> None:
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self._lltokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(self._tokenizer_loader(), n_vocab=self.vocab_size)
        return self._lltokenizer

    def validate(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError with llguidance's message when the constraint cannot be compiled."""
        import llguidance

        spec = grammar_spec(so)
        err = llguidance.LLMatcher.validate_grammar(spec, self.lltokenizer)
        if err:
            raise ValueError(f"structured_outputs.{so.kind} is invalid: {err}")

    def new_matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher at the start of the grammar (compiled grammars are cached).

        Raises:
            ValueError: the constraint does not compile.
        """
        import llguidance

        spec = grammar_spec(so)
        proto = self._compiled.get(spec)
        if proto is None:
            proto = llguidance.LLMatcher(self.lltokenizer, spec)
            if proto.is_error():
                raise ValueError(f"structured_outputs.{so.kind} is invalid: {proto.get_error()}")
            self._compiled[spec] = proto
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return proto.deep_copy()

    def grammar_bitmask(self, matchers: list[Any]) -> bytes:
        """``[len(matchers), ceil(vocab_size / 32)]`` int32 (little-endian bytes): bit t of row i
        is set when token t may come next under matcher i."""
        import llguidance.numpy as lln

        mask = lln.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            lln.fill_next_token_bitmask(m, mask, i)
        return np.ascontiguousarray(mask, dtype="<i4").tobytes()

    @staticmethod
    def accept_token(matcher: Any, token_id: int) -> bool:
        """Advance ``matcher`` by a sampled token; True when the grammar is complete (or broken:
        a token the mask forbade), so the request must stop."""
        matcher.consume_token(token_id)
        return matcher.is_stopped() or matcher.is_error()
