"""Tools and structured output through the clients people use against a vLLM-style server: the
official ``openai`` client, LangChain (``langchain-openai``: ``bind_tools``,
``with_structured_output`` by function calling and by JSON schema), LiteLLM and the OpenAI Agents
SDK (over /v1/responses), all against the
session's real server (SmolLM2, --enable-auto-tool-choice --tool-call-parser hermes)."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest

from server_utils import API_KEY, MODEL

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
                                                     "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls):
    assert calls
    for c in calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_openai_required_and_named_tool_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    _check_calls(ch.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    _check_calls(calls)
    assert [c.function.name for c in calls] == ["get_time"] and r.choices[0].finish_reason == "stop"  # forced: as OpenAI, vLLM


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_streamed_tool_calls_equal_the_response(client, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [(c.function.name, json.loads(c.function.arguments)) for c in full]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())


def test_openai_auto_and_a_tool_turn_in_the_history(client):
    """auto: the answer is either content or valid calls; a history with an assistant tool call
    and its tool result is rendered (not dropped) and answered."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    ch = r.choices[0]
    if ch.message.tool_calls:
        _check_calls(ch.message.tool_calls)
        assert ch.finish_reason == "tool_calls"
    else:
        assert ch.message.content and ch.finish_reason in ("stop", "length")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                                  max_tokens=1).usage.prompt_tokens + 20


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key=API_KEY, temperature=0, max_tokens=120, max_retries=0, timeout=120)


def get_weather(city: str, unit: str) -> str:
    """Current weather of a city."""
    return f"sunny in {city}"


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat_model, method):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    person = chat_model.with_structured_output(Person, method=method).invoke("Invent a person with a name and an age.")
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_litellm_tools_and_response_format(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=server + "/v1", api_key=API_KEY, max_tokens=120, temperature=0)
    r = litellm.completion(messages=ASK, tools=TOOLS, tool_choice="required", **kw)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    r = litellm.completion(messages=[{"role": "user", "content": "Invent a person as JSON."}],
                           response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}}, **kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), person)


def test_openai_agents_sdk_tool_loop_over_the_responses_api(server):
    """The OpenAI Agents SDK (``openai-agents``) drives /v1/responses: a forced call of a Python
    tool, its output sent back as a function_call_output item, then the model's answer (the
    SDK resets tool_choice to auto after a call); and a streamed run."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    seen = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    async def main():
        model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0))
        agent = Agent(name="helper", instructions="Answer briefly.", model=model, tools=[weather],
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        kinds = [type(i) for i in result.new_items]
        assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] == MessageOutputItem, kinds
        assert len(seen) == 1 and isinstance(result.final_output, str) and result.final_output
        plain = Agent(name="plain", instructions="Answer briefly.", model=model, model_settings=ModelSettings(temperature=0, max_tokens=120))
        streamed = Runner.run_streamed(plain, "Say hello.")
        deltas = [e.data.delta async for e in streamed.stream_events() if e.type == "raw_response_event"
                  and e.data.type == "response.output_text.delta"]
        assert "".join(deltas) == streamed.final_output and streamed.final_output

    asyncio.run(main())
