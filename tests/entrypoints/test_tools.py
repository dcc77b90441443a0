"""Tool calling without a model: tool_choice planning and its refusals, the hermes and json
parsers, and the streamed deltas, whose concatenation must equal the non-streamed result
whatever the stream boundaries (fuzzed)."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser, JsonToolParser, Llama3JsonToolParser
from pagedserve.entrypoints.openai.tools import ToolCallStream, ToolPlan, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_plan_tools_modes_and_refusals():
    assert plan_tools(None, None, False, None).mode == "none"
    assert plan_tools([WEATHER], "none", False, None).mode == "none"
    assert plan_tools([WEATHER], None, True, "hermes").mode == "auto"  # auto is the default with tools
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        plan_tools([WEATHER], "auto", False, None)
    assert e.value.param == "tool_choice"
    req = plan_tools([WEATHER, TIME], "required", False, None)
    assert req.mode == "required" and req.constraint is not None
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False, None)
    assert named.mode == "named" and named.named == "get_time" and json.loads(named.constraint.json) == TIME["function"]["parameters"]
    for tools, choice, words in [
        (None, "required", "tools` must be set"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        ([{"type": "function", "function": {}}], "none", "tools\\[0\\]"),
        ([WEATHER, WEATHER], "none", "distinct"),
        ([WEATHER] * 200, "none", "at most"),
    ]:
        with pytest.raises(APIError, match=words):
            plan_tools(tools, choice, True, "hermes")


def test_hermes_parser():
    content, calls = HermesToolParser().extract(HERMES_TEXT)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert HermesToolParser().extract("no calls here") == ("no calls here", [])
    # a block that is not a call stays content; an unclosed valid block at the end is a call
    content, calls = HermesToolParser().extract('a <tool_call>not json</tool_call> b')
    assert content == 'a <tool_call>not json</tool_call> b' and calls == []
    content, calls = HermesToolParser().extract('<tool_call>{"name": "get_time", "arguments": {}}')
    assert content is None and [c.name for c in calls] == ["get_time"]


def test_json_parser():
    p = JsonToolParser()
    content, calls = p.extract('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    content, calls = p.extract('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]')
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    assert p.extract("Hello there") == ("Hello there", [])
    assert p.extract('{"not": "a call"}') == ('{"not": "a call"}', [])


def test_llama3_json_parser():
    p = Llama3JsonToolParser()
    content, calls = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert [c.name for c in p.extract('[{"name": "get_time", "arguments": {}}]')[1]] == ["get_time"]
    for text in ("Hello there", '{"name": "get_time", "parameters": {}} and some words', '{"not": "a call"}', "<|python_tag|>", "[1, 2]"):
        assert p.extract(text) == (text, [])


def _streamed(plan: ToolPlan, text: str, rnd: random.Random) -> tuple[str, list[tuple[str, str]], set]:
    """Feed ``text`` in random pieces; returns (content, [(name, arguments)], call ids)."""
    stream = ToolCallStream(plan)
    cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, list] = {}
    ids = set()
    for d in deltas:
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            if tc.id:
                ids.add(tc.id)
            if tc.function and tc.function.name:
                entry[0] += tc.function.name
            if tc.function and tc.function.arguments:
                entry[1] += tc.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], ids


@pytest.mark.parametrize("seed", range(30))
def test_streamed_deltas_concatenate_to_the_full_result(seed):
    rnd = random.Random(seed)
    cases = [
        (ToolPlan("auto", [WEATHER, TIME], parser="hermes"), HERMES_TEXT),
        (ToolPlan("auto", [WEATHER], parser="hermes"), "Just text, with a < sign and <tool but no call."),
        (ToolPlan("auto", [WEATHER], parser="hermes"), '\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'),
        (ToolPlan("auto", [WEATHER], parser="hermes"), "   "),
        (ToolPlan("auto", [WEATHER], parser="json"), '{"name": "get_weather", "arguments": {"city": "Lima"}}'),
        (ToolPlan("auto", [WEATHER], parser="json"), "Plain answer."),
        (ToolPlan("auto", [WEATHER, TIME], parser="llama3_json"), '<|python_tag|>{"name": "get_time", "parameters": {}};{"name": "get_weather", "parameters": {"city": "Quito"}}'),
        (ToolPlan("auto", [WEATHER], parser="llama3_json"), "<|pyth not a tag, plain text."),
        (ToolPlan("auto", [WEATHER], parser="llama3_json"), "<"),
        (ToolPlan("required", [WEATHER, TIME]), '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
        (ToolPlan("named", [WEATHER], named="get_weather"), '{"city": "Kyoto"}'),
    ]
    for plan, text in cases:
        content, calls = plan.calls_from_text(text)
        got_content, got_calls, ids = _streamed(plan, text, rnd)
        assert got_content == (content or "")
        assert got_calls == [(c.name, c.arguments) for c in calls]
        assert len(ids) == len(calls) and all(i.startswith("chatcmpl-tool-") for i in ids)


def test_required_lifts_the_tools_shared_definitions():
    """pydantic's nested models come as local $refs; wrapped in the "required" array they must
    still resolve (found in review: a 400 "Pointer '/$defs/P' does not exist")."""
    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "$defs": {"P": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/P"}}, "required": ["guest"]}}}
    plan = plan_tools([nested, TIME], "required", False, None)
    schema = json.loads(plan.constraint.json)
    assert "P" in schema["$defs"] and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"P": {"type": "string"}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}}}
    with pytest.raises(APIError, match="differently"):
        plan_tools([nested, clash], "required", False, None)


def test_fallback_template_asks_for_the_parsers_format(smollm2_dir):
    """The packaged template (for models whose own ignores tools) asks for <tool_call> blocks
    under hermes and for bare JSON under json / llama3_json, and renders past calls the same way
    (a new user found llama3_json asked for tags it does not read)."""
    from pagedserve.entrypoints.openai.tools import tools_template
    from pagedserve.model.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    calls = [{"type": "function", "function": {"name": n, "arguments": {"city": c}}} for n, c in (("get_weather", "Oslo"), ("get_weather", "Rome"))]
    conv = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "sunny"}]

    def render(**kw):
        return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, chat_template=tools_template(), tools=[WEATHER], **kw)

    hermes, js = render(), render(tool_call_format="json")
    assert "inside <tool_call></tool_call> tags" in hermes and hermes.count("<tool_call>\n{") == 3  # the example and two calls
    assert "<tool_call>" not in js and "answer with only a JSON object" in js
    past = js.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [c.name for c in Llama3JsonToolParser().extract(past)[1]] == ["get_weather", "get_weather"]


NO_PARAMS = [{"type": "function", "function": {"name": "now", "description": "The current time"}},
             {"type": "function", "function": {"name": "now", "description": "The current time", "parameters": {}}}]


@pytest.mark.parametrize("tool", NO_PARAMS, ids=["omitted", "empty"])
def test_a_tool_without_parameters_is_an_empty_closed_object(tool):
    """Issue 46: as OpenAI documents and vLLM compiles it, not {"type": "object"} (any object)."""
    empty = {"type": "object", "properties": {}}
    named = plan_tools([tool], {"type": "function", "function": {"name": "now"}}, False, None)
    assert json.loads(named.constraint.json) == empty
    req = plan_tools([tool, WEATHER], "required", False, None)
    assert json.loads(req.constraint.json)["items"]["anyOf"][0]["properties"]["parameters"] == empty


def _stream_calls(http, body) -> tuple[list[tuple[str, str]], str]:
    """(name, joined arguments) of each streamed call, and the finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            for tc in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += (tc.get("function") or {}).get("name") or ""
                entry[1] += (tc.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool", NO_PARAMS, ids=["omitted", "empty"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_of_a_tool_without_parameters_gets_empty_arguments_at_once(server, tool, choice):
    """Issue 46: the arguments were an echo of the tool's definition, or ran to max_tokens.
    They are exactly "{}", whatever the model, in a few tokens, streamed or not."""
    from server_utils import AUTH, MODEL, httpx

    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "now"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What time is it?"}], "tools": [tool],
            "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    text = '[{"name": "now", "parameters": {}}]' if choice == "required" else "{}"
    finish = "tool_calls" if choice == "required" else "stop"
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        ch = out["choices"][0]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"]["tool_calls"]] == [("now", "{}")]
        assert ch["finish_reason"] == finish and not ch["message"]["content"]
        assert out["usage"]["completion_tokens"] <= len(text) + 1  # the forced text (and EOS), never a run to max_tokens
        assert _stream_calls(http, body) == ([("now", "{}")], finish)
