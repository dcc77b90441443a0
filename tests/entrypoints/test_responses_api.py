"""``POST /v1/responses`` on a tiny random model served in process, driven by the official
``openai`` client where it can be: the answer equals the chat endpoint's for the same
conversation (greedy), streamed events add up to the whole response, function tools and
``text.format`` work, and what needs a response store or hosted tools is a 400."""
from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.server_args import ServerArgs

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(tiny_url):
    return openai.OpenAI(base_url=tiny_url + "/v1", api_key="none", max_retries=0)


def _chat(url: str, messages: list[dict], **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()


def _events(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def test_text_equals_chat_whole_and_streamed(tiny_url, client, tiny_llm):
    convo = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]}, {"role": "user", "content": "More?"}]
    want = _chat(tiny_url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}], max_tokens=9)
    r = client.responses.create(model="tiny", input=convo, max_output_tokens=9, temperature=0, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.metadata == {"k": "v"}
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    cut = want["choices"][0]["finish_reason"] == "length"
    assert r.output[0].status == ("incomplete" if cut else "completed")
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (("incomplete", "max_output_tokens") if cut else ("completed", None))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    # instructions are the system turn; a string input is one user turn.
    a = client.responses.create(model="tiny", instructions="Be brief.", input="More?", max_output_tokens=5, temperature=0)
    b = _chat(tiny_url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "More?"}], max_tokens=5)
    assert a.output_text == b["choices"][0]["message"]["content"] and a.instructions == "Be brief."
    # Streamed: numbered from 0, deltas add up, and the last event is the whole response.
    events = _events(client, model="tiny", input=convo, max_output_tokens=9, temperature=0)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text
    last = events[-1]
    assert last.type == ("response.incomplete" if cut else "response.completed")
    assert last.response.output[0].content[0].text == text and last.response.usage.output_tokens == r.usage.output_tokens
    kv_idle(tiny_llm)


def test_function_tools_round_trip(tiny_url, client, tiny_llm):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=60,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed" and all(c.name == "get_weather" for c in calls)
    assert all(json.loads(c.arguments)["city"] in ("Paris", "Rome") for c in calls)
    assert len({c.call_id for c in calls}) == len(calls) and all(c.id.startswith("fc_") for c in calls)
    # Streamed with the client's helper: the final response carries the same calls (ids aside).
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in calls]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in calls)
    # A named choice; then the calls and their outputs go back as input items.
    one = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=60, temperature=0)
    call = one.output[0]
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = [{"role": "user", "content": "Weather?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model="tiny", input=follow, tools=TOOLS, tool_choice="none", max_output_tokens=6, temperature=0)
    want = _chat(tiny_url, [{"role": "user", "content": "Weather?"},
                       {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                                                                             "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
                 tools=[{"type": "function", "function": {k: TOOLS[0][k] for k in ("name", "description", "parameters")}}], tool_choice="none",
                 max_tokens=6)
    assert r2.output_text == want["choices"][0]["message"]["content"] and r2.usage.input_tokens == want["usage"]["prompt_tokens"]
    # Without tools the history's call is still rendered (the packaged template, as with tools).
    bare = httpx.post(tiny_url + "/tokenize", json={"model": "tiny", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]}).json()["tokens"]
    text = httpx.post(tiny_url + "/detokenize", json={"model": "tiny", "tokens": bare}).json()["prompt"]
    assert "<tool_call>" in text and call.arguments in text and "<tool_response>" in text
    r3 = client.responses.create(model="tiny", input=follow, max_output_tokens=2, temperature=0)
    assert r3.usage.input_tokens == len(bare)
    kv_idle(tiny_llm)


def test_text_format_json_schema(client, tiny_llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Answer in JSON.", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["ok"], bool)
    kv_idle(tiny_llm)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": "json_object"}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "number", "maximum": float("nan")}}],
      "tool_choice": "none"}, "tools"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"user": "\ud800"}, "user"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f\ud800", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": "Hi " * 600}, "input"),
    ({"input": None, "instructions": "Be brief."}, "input"),
    ({"tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"temperature": -1}, "temperature"),
])
def test_refusals_are_400s_naming_the_field(tiny_url, tiny_llm, body, param):
    r = httpx.post(tiny_url + "/v1/responses", content=json.dumps({"model": "tiny", "input": "Hi", **body}),  # NaN and \ud800 pass
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert "max_completion_tokens" not in r.text and "messages" not in r.text and "response_format" not in r.text or param == "response_format"
    kv_idle(tiny_llm)


def test_ids_store_and_reasoning_fields(tiny_url, client, tiny_llm):
    r = httpx.post(tiny_url + "/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, "request_id": "abc",
                                                 "store": True, "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200 and r.json()["id"] == "resp_abc" and r.json()["store"] is False  # nothing is stored
    r = httpx.post(tiny_url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "user": "u1"}).json()
    assert r["user"] == "u1" and r["temperature"] == 1.0 and r["top_p"] == 1.0  # as sampled
    assert httpx.post(tiny_url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                      headers={"X-Request-Id": "h1"}).json()["id"] == "resp_h1"
    assert httpx.post(tiny_url + "/v1/responses", json={"model": "other", "input": "Hi"}).status_code == 404
    for method, path in (("GET", "/v1/responses/resp_abc"), ("DELETE", "/v1/responses/resp_abc"), ("POST", "/v1/responses/resp_abc/cancel")):
        r = httpx.request(method, tiny_url + path)
        assert r.status_code == 404 and "stores no responses" in r.json()["error"]["message"], (method, path)
    kv_idle(tiny_llm)


def test_reasoning_items(thinking_model):
    """With --reasoning-parser, the thinking becomes a reasoning item (its tokens counted), the
    answer after </think> the message."""
    llm = tiny_async_llm(thinking_model)
    try:
        with serve(llm, ServerArgs(reasoning_parser="deepseek_r1")) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            no_tags = {"49152": -100, "49153": -100}
            kw = dict(model="tiny", input="Think first.", max_output_tokens=6, temperature=0)
            chat = _chat(base, [{"role": "user", "content": "Think first."}], max_tokens=6, logit_bias=no_tags)["choices"][0]["message"]
            r = client.responses.create(**kw, extra_body={"logit_bias": no_tags})
            assert [o.type for o in r.output] == ["reasoning"] and r.status == "incomplete"
            assert r.output[0].content[0].text == chat["reasoning_content"] and r.usage.output_tokens_details.reasoning_tokens == 6
            events = _events(client, **kw, extra_body={"logit_bias": no_tags})
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat["reasoning_content"]
            # </think> forced first: no reasoning item (it is empty), the message; one reasoning token.
            forced = client.responses.create(**kw, extra_body={"logit_bias": {"49153": 100}})
            assert forced.usage.output_tokens_details.reasoning_tokens == 1 and forced.output[-1].type == "message"
            streamed = _events(client, **kw, extra_body={"logit_bias": {"49153": 100}})
            assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == forced.output_text
        kv_idle(llm)
    finally:
        llm.shutdown()


def test_timeout_failure_and_disconnect(tiny_url, client, tiny_llm, monkeypatch):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=400, extra_body={"timeout": 0.001})
    assert r.status == "incomplete" and r.incomplete_details.reason == "timeout"
    # A client that leaves mid-stream: its request is aborted, its blocks come back.
    body = {"model": "tiny", "input": "Tell me a story.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", tiny_url + "/v1/responses", json=body, timeout=60) as s:
        lines = s.iter_lines()
        assert sum(line.startswith("data: ") for line, _ in zip(lines, range(12))) >= 4
    kv_idle(tiny_llm)
    # A request that fails after it started: an error event, then response.failed.
    from pagedserve.engine.input_processor import RequestError
    from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat

    real = OpenAIServingChat.chat_chunks

    async def failing(self, *args, **kwargs):
        async for n, c in _numbered(real(self, *args, **kwargs)):
            yield c
            if n == 1:  # the role, then the first token
                raise RequestError("the grammar could not be followed", param=None)

    monkeypatch.setattr(OpenAIServingChat, "chat_chunks", failing)
    events = _events(client, model="tiny", input="Hi", max_output_tokens=20, temperature=0)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "the grammar could not be followed" and events[-2].code == "invalid_request_error"
    assert events[-1].response.status == "failed" and events[-1].response.error.message == events[-2].message
    kv_idle(tiny_llm)


async def _numbered(gen):
    n = 0
    async with contextlib.aclosing(gen) as g:
        async for c in g:
            yield n, c
            n += 1


def test_output_items_follow_the_deltas_in_order():
    """Text around tool calls: each run of text is its own message item, between the calls, in
    the whole answer and the stream alike (both come from OutputItems)."""
    from pagedserve.entrypoints.openai.protocol_responses import (
        ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaFunctionCall, DeltaMessage, DeltaToolCall, UsageInfo,
    )
    from pagedserve.entrypoints.openai.serving_responses import OutputItems

    def chunk(finish=None, **delta):
        return ChatCompletionStreamResponse(id="c", model="m", choices=[ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(**delta), finish_reason=finish)])

    def call(i, name, args):
        return [DeltaToolCall(index=i, id=f"call{i}", type="function", function=DeltaFunctionCall(name=name, arguments=args))]

    items = OutputItems()
    events = []
    for c in [chunk(role="assistant", content=""), chunk(content="Sure"), chunk(content="."), chunk(tool_calls=call(0, "f", '{"a": 1}')),
              chunk(content="\n"), chunk(tool_calls=call(1, "g", "{}"), finish="tool_calls"),
              ChatCompletionStreamResponse(id="c", model="m", choices=[], usage=UsageInfo(prompt_tokens=3, completion_tokens=9, total_tokens=12))]:
        events += items.feed(c)
    events += items.finish()
    got = [(o["type"], o.get("content", [{}])[0].get("text") if o["type"] == "message" else o["arguments"]) for o in items.done]
    assert got == [("message", "Sure."), ("function_call", '{"a": 1}'), ("message", "\n"), ("function_call", "{}")]
    assert all(o["status"] == "completed" for o in items.done) and items.usage.completion_tokens == 9
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == [o["type"] for o in items.done]
    # Cut by the token limit: the last item is incomplete.
    cut = OutputItems()
    cut.feed(chunk(content="abc", finish="length"))
    cut.finish()
    assert cut.done[0]["status"] == "incomplete"


def test_request_id_header_on_a_500_and_utf8_ids(tiny_llm, monkeypatch):
    from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses

    with serve(tiny_llm, ServerArgs(enable_request_id_headers=True)) as base:
        r = httpx.post(base + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, headers={"X-Request-Id": "é-1".encode()})
        assert r.json()["id"] == "resp_é-1" and r.headers["x-request-id"] == "é-1"
        # The header names the answer's id: the body's request_id, else the random one.
        r = httpx.post(base + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "request_id": "body-7"})
        assert r.json()["id"] == "resp_body-7" and r.headers["x-request-id"] == "body-7"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]

        def broken(self, req):
            raise KeyError("a bug")

        monkeypatch.setattr(OpenAIServingResponses, "prepare", broken)
        r = httpx.post(base + "/v1/responses", json={"input": "Hi"}, headers={"X-Request-Id": "e500"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "e500" and r.json()["error"]["type"] == "InternalServerError"
    kv_idle(tiny_llm)


def test_chat_tool_history_with_a_lone_surrogate_is_a_400(tiny_url, tiny_llm):
    """A call in the history is rendered now even without tools: its text is checked like a message's."""
    call = {"id": "c1", "type": "function", "function": {"name": "f\ud800", "arguments": "{}"}}
    for path, key in (("/v1/chat/completions", "messages"), ("/tokenize", "messages")):
        body = {"model": "tiny", key: [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "1"}], "max_tokens": 2}
        r = httpx.post(tiny_url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (path, r.text)
    tools = [{"type": "function", "function": {"name": "f", "description": "d\ud800", "parameters": {"type": "object"}}}]
    r = httpx.post(tiny_url + "/v1/chat/completions", content=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                                           "tools": tools, "tool_choice": "none"}),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    kv_idle(tiny_llm)


def test_output_text_logprobs_equal_chat(tiny_url, client, tiny_llm):
    kw = dict(model="tiny", input="Hi", max_output_tokens=6, temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)
    want = _chat(tiny_url, [{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    r = client.responses.create(**kw)
    part = r.output[0].content[0]
    got = [lp.model_dump(exclude_none=True) for lp in part.logprobs]
    assert [(g["token"], g["logprob"], g["bytes"]) for g in got] == [(w["token"], w["logprob"], w["bytes"]) for w in want]
    assert [[t["token"] for t in g["top_logprobs"]] for g in got] == [[t["token"] for t in w["top_logprobs"]] for w in want]
    assert all(len(g["top_logprobs"]) == 2 for g in got) and r.top_logprobs == 2
    events = _events(client, **kw)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [g["token"] for g in got]
    assert [lp.token for lp in next(e for e in events if e.type == "response.output_text.done").logprobs] == streamed
    plain = client.responses.create(model="tiny", input="Hi", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []
    kv_idle(tiny_llm)
