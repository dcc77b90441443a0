"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) driven by the
official ``anthropic`` SDK against the session's real server (SmolLM2, --api-key,
--enable-auto-tool-choice --tool-call-parser hermes): greedy answers equal the chat endpoint's
for the same conversation, the stream's events come in Anthropic's order and add up to the
whole message, a forced tool call goes round trip, count_tokens equals the usage, and bad
bodies are 400s in Anthropic's error shape (plain httpx there). Plus the translation alone,
without a server."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.messages_api import to_chat_request
from pagedserve.entrypoints.openai.protocol_anthropic import AnthropicMessagesRequest
from server_utils import API_KEY, MODEL, wait_idle

GREEDY = {"temperature": 0}  # the 2.x SDK sends sampling fields through extra_body
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)


def _chat(client, messages: list[dict], max_tokens: int, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def _text(message) -> str:
    assert all(b.type == "text" for b in message.content)
    return "".join(b.text for b in message.content)


def test_create_equals_chat_plain_system_multi_turn_and_stop_sequences(claude, client, server):
    r = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    assert (r.type, r.role, r.model, r.stop_sequence) == ("message", "assistant", MODEL, None) and r.id.startswith("msg_")
    want = _chat(client, ASK, 12)
    assert _text(r) == want.choices[0].message.content and len(r.content) == 1
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    # system as text blocks, turns as blocks, consecutive user turns combined into one.
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}, {"role": "user", "content": "One word."}]
    r = claude.messages.create(model=MODEL, max_tokens=8, system=[{"type": "text", "text": "Be brief."}], messages=convo, metadata={"user_id": "u1"},
                               extra_body=GREEDY)
    want = _chat(client, [{"role": "system", "content": "Be brief."}, *convo[:2], {"role": "user", "content": "Name a color.\nOne word."}], 8)
    assert _text(r) == want.choices[0].message.content and r.usage.input_tokens == want.usage.prompt_tokens
    # A final assistant turn is continued (prefill): chat's continue_final_message.
    pre = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    r = claude.messages.create(model=MODEL, max_tokens=6, messages=pre, extra_body=GREEDY)
    want = _chat(client, pre, 6, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert _text(r) == want.choices[0].message.content
    # stop_sequences: a string from the middle of the greedy answer stops it there.
    full = _text(claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY))
    assert len(full) >= 8
    stop = full[len(full) // 2: len(full) // 2 + 3]
    r = claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=["\x00never", stop], extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert _text(r) == full[: full.index(stop)]
    wait_idle(server)


def test_stream_event_order_and_final_message(claude, server):
    kw = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        events = [e for e in s if e.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                                             "message_delta", "message_stop")]
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop" and set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens == whole.usage.input_tokens
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(whole)
    assert _text(final) == _text(whole) and final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens
    # On the wire: event/data lines, a ping after message_start.
    with httpx.stream("POST", server + "/v1/messages", headers=HEADERS, json={**kw.pop("extra_body"), **kw, "max_tokens": 2, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    assert [f[0] for f in frames[:2]] == ["event: message_start", "event: ping"] and frames[-1][0] == "event: message_stop"
    assert all(f[0] == "event: " + json.loads(f[1][len("data: "):])["type"] for f in frames)
    wait_idle(server)


def test_tool_round_trip(claude, client, server):
    kw = dict(model=MODEL, max_tokens=40, tools=[TOOL], messages=ASK, extra_body=GREEDY)
    r = claude.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_") and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, SCHEMA)
    # Streamed: the same call, its input in input_json_delta pieces.
    with claude.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", uses[0].input)] and final.stop_reason == "tool_use"
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert pieces and json.loads("".join(pieces)) == uses[0].input
    # "any" with one call at most.
    r_any = claude.messages.create(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r_any.stop_reason == "tool_use" and [b.type for b in r_any.content] == ["tool_use"]
    jsonschema.validate(r_any.content[0].input, SCHEMA)
    # The call and its result go back; tool_choice none: a text answer, over chat's rendering.
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    r2 = claude.messages.create(model=MODEL, max_tokens=8, tools=[TOOL], tool_choice={"type": "none"}, messages=follow, extra_body=GREEDY)
    assert r2.stop_reason in ("end_turn", "max_tokens") and r2.content and all(b.type == "text" for b in r2.content)
    chat_call = {"id": uses[0].id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}
    want = _chat(client, [*ASK, {"role": "assistant", "content": "", "tool_calls": [chat_call]},
                          {"role": "tool", "tool_call_id": uses[0].id, "content": "Sunny, 21 C"}], 8,
                 tools=[{"type": "function", "function": {"name": "get_weather", "description": TOOL["description"], "parameters": SCHEMA}}],
                 tool_choice="none")
    assert _text(r2) == want.choices[0].message.content and r2.usage.input_tokens == want.usage.prompt_tokens
    # count_tokens: the prompt the same request has.
    n = claude.messages.count_tokens(model=MODEL, tools=[TOOL], tool_choice={"type": "none"}, messages=follow)
    assert n.input_tokens == r2.usage.input_tokens
    assert claude.messages.count_tokens(model=MODEL, tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                        messages=ASK).input_tokens == r.usage.input_tokens
    assert claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens == _chat(client, ASK, 1).usage.prompt_tokens
    wait_idle(server)


def test_api_key(server):
    for bad in ("wrong-key", ""):
        c = anthropic.Anthropic(base_url=server, api_key=bad or "x", max_retries=0, timeout=30)
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert e.value.status_code == 401 and e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            c.messages.count_tokens(model=MODEL, messages=ASK)
    r = httpx.post(server + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK}, timeout=30)  # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


BAD = [
    ({"messages": ASK}, "max_tokens"),  # required
    ({"max_tokens": "ten", "messages": ASK}, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "bogus", "text": "hi"}]}]}, "bogus"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]}, "tool_use"),
    ({"max_tokens": 4, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 4, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "x"}]}, "input_schema"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"max_tokens": 4, "messages": ASK, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "tools": [TOOL], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "tool_choice 'any' and output_config.format"),
    ({"max_tokens": 4, "messages": ASK, "stream": True, "system": [{"type": "image"}]}, "system"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                                             "input": {}}]}], "tools": [TOOL]}, "tool_result"),
]


def test_bad_bodies_are_anthropic_400s_and_the_server_serves_on(server, claude):
    def check(resp, status=400, kind="invalid_request_error", words=""):
        body = resp.json()
        assert resp.status_code == status, body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
        assert words in body["error"]["message"], body

    for body, words in BAD:
        check(httpx.post(server + "/v1/messages", headers=HEADERS, json={"model": MODEL, **body}, timeout=30), words=words)
    check(httpx.post(server + "/v1/messages", headers={**HEADERS, "content-type": "application/json"}, content=b'{"model": "x",', timeout=30),
          words="JSON")
    check(httpx.post(server + "/v1/messages/count_tokens", headers=HEADERS, json={"model": MODEL}, timeout=30), words="messages")
    check(httpx.post(server + "/v1/messages/count_tokens", headers=HEADERS, json={"model": MODEL, "messages": ASK, "tools": [TOOL],
                                                                                 "tool_choice": {"type": "tool", "name": "nope"}}, timeout=30),
          words="nope")
    check(httpx.post(server + "/v1/messages", headers=HEADERS, json={"model": "claude-x", "max_tokens": 2, "messages": ASK}, timeout=30),
          404, "not_found_error", "claude-x")
    check(httpx.get(server + "/v1/messages", headers=HEADERS, timeout=30), 405)
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK reads the shape
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "bogus"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # Other routes keep OpenAI's shape; the server still answers.
    assert "message" in httpx.post(server + "/v1/chat/completions", headers=HEADERS, json={"model": MODEL}, timeout=30).json()["error"]
    r = claude.messages.create(model=MODEL, max_tokens=2, messages=ASK, service_tier="auto", extra_body={"thinking": {"type": "disabled"}})
    assert r.usage.output_tokens == 2 and r.stop_reason == "max_tokens"
    wait_idle(server)


def test_translation_to_chat():
    req = AnthropicMessagesRequest(
        model="m", max_tokens=5, system="S", stop_sequences=["X"], top_k=3, tools=[TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "Let me see."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "text", "text": "And?"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": "down"}]},
        ],
    )
    chat = to_chat_request(req)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                                         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And?"},
    ]
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.tool_choice, chat.parallel_tool_calls) == (5, ["X"], 3, "auto", False)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "description": TOOL["description"]}}]
    assert chat.add_generation_prompt and not chat.continue_final_message and not chat.include_reasoning
    fmt = to_chat_request(AnthropicMessagesRequest(model="m", max_tokens=1, messages=ASK, output_config={"format": {"type": "json_schema",
                                                                                                               "schema": SCHEMA}}))
    assert fmt.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}
    with pytest.raises(APIError, match="strict") as e:
        to_chat_request(AnthropicMessagesRequest(model="m", max_tokens=1, messages=ASK, tools=[{**TOOL, "strict": True}]))
    assert e.value.param == "tools"


def test_a_failure_mid_stream_is_an_error_event():
    """After message_start the stream cannot become a 4xx: the failure is an ``error`` event in
    Anthropic's shape, and the message never stops."""
    import asyncio

    from pagedserve.entrypoints.openai.protocol_responses import ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaMessage
    from pagedserve.entrypoints.openai.serving_common import TokenizedPrompt
    from pagedserve.entrypoints.openai.serving_messages import AnthropicServingMessages, PreparedMessage

    class FailingChats:
        async def chat_chunks(self, *args):
            yield ChatCompletionStreamResponse(id="x", model="m", choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="Hi"))])
            raise APIError("the grammar could not be followed.")

    prepared = PreparedMessage(None, "m", [], TokenizedPrompt(None, [1, 2, 3]), None, None)

    async def frames() -> list[str]:
        return [f async for f in AnthropicServingMessages(FailingChats()).message_stream("msg_1", prepared, "e")]

    out = asyncio.run(frames())
    kinds = [f.split("\n")[0] for f in out]
    assert kinds == ["event: message_start", "event: ping", "event: content_block_start", "event: content_block_delta", "event: error"]
    assert json.loads(out[-1].split("\n")[1][len("data: "):]) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                                          "message": "the grammar could not be followed."}}


NOT_OBJECT_SCHEMAS = [{"type": "string"}, {"anyOf": [{"type": "object"}, {"type": "string"}]}, {"type": "integer"}, {"type": "array"}, {}]


def test_a_tool_whose_input_is_not_an_object_is_refused_up_front(server):
    """Anthropic requires ``input_schema`` of ``"type": "object"``: anything else is a 400
    naming the tool, before anything is generated (streamed or not, and for count_tokens)."""
    for schema in NOT_OBJECT_SCHEMAS:
        with pytest.raises(APIError, match="'echo'.*\"type\": \"object\"") as e:
            to_chat_request(AnthropicMessagesRequest(model="m", max_tokens=1, messages=ASK, tools=[{"name": "echo", "input_schema": schema}],
                                                     tool_choice={"type": "tool", "name": "echo"}))
        assert e.value.param == "tools" and "tools[0].input_schema.type" in e.value.message
    tools = [TOOL, {"name": "echo", "input_schema": {"type": "string"}}]
    for path, extra in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages", {"max_tokens": 8, "stream": True}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(server + path, headers=HEADERS, json={"model": MODEL, "messages": ASK, "tools": tools,
                                                             "tool_choice": {"type": "tool", "name": "echo"}, **extra}, timeout=30)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "tools[1].input_schema.type" in body["error"]["message"] and "'echo'" in body["error"]["message"]


def test_cut_tool_arguments_never_fail_the_message():
    """A tool call's arguments cut anywhere (max_tokens) that are not the start of a JSON object
    (a cut string, a number, garbage) close as ``input: {}``; an object's prefix keeps its finished members."""
    from pagedserve.entrypoints.openai.serving_messages import ContentBlocks

    for args, want in (('"EOF while parsing a str', {}), ("[1, 2", {}), ("12", {}), ("nonsense", {}), ("1" * 5000, {}),
                       ('{"city": "Paris", "da', {"city": "Paris"}), ('{"a": 1, "b', {"a": 1}), ("", {})):
        blocks = ContentBlocks()
        blocks.cur, blocks.parts = {"type": "tool_use", "id": "toolu_1", "name": "echo", "input": {}}, [args[:3], args[3:]]
        assert blocks.finish() == [{"type": "content_block_stop", "index": 0}]
        assert blocks.done == [{"type": "tool_use", "id": "toolu_1", "name": "echo", "input": want}], args
