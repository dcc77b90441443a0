"""Structured output on the real model (SmolLM2, float32): every answer that finishes with "stop"
validates against its JSON schema (checked with jsonschema, independently of the grammar
library), matches its regex or is one of its choices; an answer cut by length is a prefix of a
valid one; constrained requests do not change unconstrained ones in the same batch, and
preemption does not change them either."""
from __future__ import annotations

import json
import random
import re

import numpy as np

import jsonschema
import pytest

from conftest import assert_engine_idle
from pagedserve import SamplingParams
from pagedserve.engine.input_processor import RequestError
from pagedserve.sampling_params import StructuredOutputsParams as Constraint

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]},
        "population": {"type": "integer", "minimum": 0},
        "districts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    }, "required": ["city", "districts"]},
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}},
        }, "required": ["id", "items"]},
        "paid": {"type": "boolean"},
    }, "required": ["order", "paid"]},
]
PROMPT = [{"role": "user", "content": "Answer in JSON: describe something for a database."}]


def _chat(llm, constraint, **kw):
    kw.setdefault("max_tokens", 120)
    return llm.chat(PROMPT, SamplingParams(structured_outputs=constraint, **kw), use_tqdm=False)[0]


def _is_prefix_of_valid(llm, constraint, token_ids) -> bool:
    """Whether the grammar accepts these tokens so far (the answer can still be completed)."""
    grammars = llm.llm_engine.input_processor.grammars
    m = grammars.new_matcher(constraint)
    return all(m.consume_token(t) for t in token_ids) and not m.is_error()


@pytest.mark.parametrize("schema", [SCHEMAS[0], SCHEMAS[1], pytest.param(SCHEMAS[2], marks=pytest.mark.slow)], ids=["flat", "enum-array", "nested-pattern"])
def test_json_schema_greedy_and_sampled(smollm2_llm, schema):
    c = Constraint(json=schema)
    outs = [_chat(smollm2_llm, c, temperature=0.0).outputs[0]]
    outs += _chat(smollm2_llm, c, temperature=1.0, seed=5, n=3).outputs
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
            assert "\n" not in o.text and "  " not in o.text.replace('"  ', "")  # no free whitespace
        else:
            assert o.finish_reason == "length" and _is_prefix_of_valid(smollm2_llm, c, o.token_ids)
    assert_engine_idle(smollm2_llm)


def test_cut_by_length_is_a_prefix(smollm2_llm):
    c = Constraint(json=SCHEMAS[2])
    o = _chat(smollm2_llm, c, temperature=0.0, max_tokens=9).outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 9
    assert _is_prefix_of_valid(smollm2_llm, c, o.token_ids)
    with pytest.raises(json.JSONDecodeError):
        json.loads(o.text)


def test_regex_choice_grammar_and_json_object(smollm2_llm):
    o = _chat(smollm2_llm, Constraint(regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"), temperature=0.0).outputs[0]
    assert o.finish_reason == "stop" and re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", o.text), o.text
    for temperature in (0.0, 1.0):
        outs = _chat(smollm2_llm, Constraint(choice=["yes", "no", "it depends"]), temperature=temperature, seed=3, n=4).outputs
        assert all(x.text in ("yes", "no", "it depends") and x.finish_reason == "stop" for x in outs)
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    o = _chat(smollm2_llm, Constraint(grammar=gbnf), temperature=0.0).outputs[0]
    assert re.fullmatch(r"color: (red|green|blue)", o.text) and o.finish_reason == "stop"
    lark = 'start: "n=" /[0-9]{2}/'
    o = _chat(smollm2_llm, Constraint(grammar=lark), temperature=0.0).outputs[0]
    assert re.fullmatch(r"n=[0-9]{2}", o.text)
    person = [{"role": "user", "content": "Give me a person as JSON with name, age and city."}]
    o = smollm2_llm.chat(person, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Constraint(json_object=True)),
                         use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text
    assert_engine_idle(smollm2_llm)


def test_constrained_beside_unconstrained_in_one_batch(smollm2_llm):
    """Masks land on their own rows only: the unconstrained requests of a mixed batch give the
    tokens they give alone, and the constrained ones the tokens they give alone."""
    tok = smollm2_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(t)["input_ids"]} for t in ("The capital of France is", "def add(a, b):", "Colors: red,")]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(json=SCHEMAS[0]))
    alone_plain = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, plain, use_tqdm=False)]
    alone_json = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, constrained, use_tqdm=False)]
    mixed = smollm2_llm.generate(prompts * 2, [plain] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone_plain
    assert [o.outputs[0].token_ids for o in mixed[3:]] == alone_json
    assert_engine_idle(smollm2_llm)


def test_preemption_keeps_the_grammar_state(tiny_model_factory):
    """A pool so small that constrained requests are preempted and recomputed: the matcher keeps
    its place (it lives with the request, not with its KV) and the answers equal a large pool's."""
    from pagedserve import LLM

    path = tiny_model_factory("llama")
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}}}, "required": ["k"]}
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=Constraint(json=schema))
    prompts = [{"prompt_token_ids": [5 + i] * (20 + 3 * i)} for i in range(5)]
    big = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=128)
    small = LLM(path, dtype="float32", num_kv_blocks=10, max_model_len=128)
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    got = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert small.stats().num_preemptions > 0
    for o in got:
        assert _is_prefix_of_valid(small, params.structured_outputs, o.outputs[0].token_ids)
    assert_engine_idle(small)


@pytest.mark.parametrize("constraint,words", [
    (dict(json={"type": "objectx"}), "invalid"),
    (dict(json='{"type": "object"'), "not valid JSON"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="start: undefined_rule"), "unknown name"),
    (dict(grammar="root ::= ("), "grammar"),
    # Issue 46: llguidance drops a lone trailing backslash, which changed the constraint's meaning.
    (dict(regex="\\"), "lone trailing backslash"),
    (dict(regex="ab\\"), "lone trailing backslash"),
    (dict(json={"type": "array", "items": {"type": "string", "pattern": "a\\"}}), "/items/pattern"),
    (dict(grammar='start: "x" %json {"type": "string", "pattern": "a\\\\"}'), "backslash"),
])
def test_invalid_constraints_are_refused_before_the_engine(smollm2_llm, constraint, words):
    with pytest.raises(RequestError, match=words) as e:
        smollm2_llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=Constraint(**constraint)), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert_engine_idle(smollm2_llm)


def test_valid_regexes_keep_their_meaning(smollm2_llm):
    """What llguidance's regex syntax allows is still accepted, backslashes included."""
    grammars = smollm2_llm.llm_engine.input_processor.grammars
    tok = smollm2_llm.get_tokenizer()

    def accepts(rx, text):
        m = grammars.new_matcher(Constraint(regex=rx))
        return all(m.consume_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and m.is_accepting()

    for rx, text in [("\\d+", "42"), ("[a-z]+", "abc"), ("(ab|cd){2}", "abcd"), ("a\\\\", "a\\"), ("\\p{L}+", "héllo"), ("a/b\\/", "a/b/")]:
        grammars.validate(Constraint(regex=rx))
        assert accepts(rx, text), (rx, text)
    assert not accepts("a\\\\", "a")


def test_constraint_shape_is_checked():
    for bad in (dict(), dict(json={"type": "object"}, regex="a"), dict(choice=[]), dict(choice=["a", ""]), dict(regex=" "),
                dict(grammar="x" * 70_000)):
        with pytest.raises(ValueError, match="structured_outputs"):
            Constraint(**bad)


def test_objects_are_closed_unless_the_schema_opens_them(smollm2_llm):
    """As vLLM's default backend (xgrammar, strict mode): properties the schema does not name are
    refused at every depth, unless the schema allows them itself."""
    grammars = smollm2_llm.llm_engine.input_processor.grammars
    tok = smollm2_llm.get_tokenizer()

    def accepts(schema, text):
        m = grammars.new_matcher(Constraint(json=schema))
        return all(m.consume_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and not m.is_error()

    inner = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = {"type": "object", "properties": {"x": inner}}
    assert accepts(closed, '{"x": {"a": 1}}')
    assert not accepts(closed, '{"x": {"a": 1, "b": 2}}') and not accepts(closed, '{"x": {"a": 1}, "y": 2}')
    opened = {"type": "object", "properties": {"x": {**inner, "additionalProperties": True}}, "additionalProperties": True}
    assert accepts(opened, '{"x": {"a": 1, "b": 2}, "y": 3}')


def test_a_grammar_that_fails_ends_its_request_with_an_error_never_stop(smollm2_llm):
    """Found in review: a matcher error (llguidance's limits, or every allowed token masked) used
    to finish as "stop" with an answer that breaks the constraint. It is an "error" now, with
    the reason, and the engine goes on."""
    outs = smollm2_llm.generate(["hi"] * 3, [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(regex="(a{1000}){1000}")),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=Constraint(grammar="start: e\ne: e e | e e e | /[a-z]/")),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ], use_tqdm=False)
    for o in outs[:2]:
        c = o.outputs[0]
        assert c.finish_reason in ("error", "length"), (c.finish_reason, c.text)
        if c.finish_reason == "error":
            assert "structured output failed" in c.stop_reason or "too slow" in c.stop_reason
    assert outs[2].outputs[0].finish_reason == "length" and len(outs[2].outputs[0].token_ids) == 8
    # The ambiguous grammar's Earley sets grow with random tokens; the parser limit stops it
    # within a few dozen tokens (llguidance's default limit let one mask take 0.7-1.4 s).
    grammars = smollm2_llm.llm_engine.input_processor.grammars
    m = grammars.new_matcher(Constraint(grammar="start: e\ne: e e | e e e | /[a-z]/"))
    rnd = random.Random(0)
    state = None
    for _ in range(200):
        mask, _slow = grammars.grammar_bitmask([m])
        if m.is_error():  # the limit hit while computing the mask: nothing is allowed
            state = m.get_error()
            break
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: grammars.vocab_size]
        allowed = [int(t) for t in np.flatnonzero(bits) if t != 2]
        state = grammars.accept_token(m, rnd.choice(allowed))
        if state is not None:
            break
    assert state is not None and "Too many items" in state, state
    # min_tokens masks the only token a finished grammar allows (EOS): an error, not a "stop"
    c = smollm2_llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5,
                                                  structured_outputs=Constraint(choice=["ok"])), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason in ("stop", "error") and (c.finish_reason == "error" or c.text == "ok")
    assert_engine_idle(smollm2_llm)


def test_all_of_and_refs_are_not_broken_by_closing_objects(smollm2_llm):
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    smollm2_llm.llm_engine.input_processor.grammars.validate(Constraint(json=both))
    refs = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}
    o = _chat(smollm2_llm, Constraint(json=refs), temperature=0.0, max_tokens=40).outputs[0]
    if o.finish_reason == "stop":
        jsonschema.validate(json.loads(o.text), refs)
    for bad in (dict(choice="abc"), dict(json_object="yes")):
        with pytest.raises(ValueError, match="structured_outputs"):
            Constraint(**bad)
    deep = "[" * 2000 + "]" * 2000
    with pytest.raises(RequestError, match="deeply"):
        smollm2_llm.generate("hi", SamplingParams(max_tokens=2, structured_outputs=Constraint(json='{"enum": ' + deep + "}")), use_tqdm=False)
