"""Request validation of the OpenAI server, in process: the real FastAPI app and the real
InputProcessor (SmolLM2's tokenizer, max_model_len 2048), but no engine at all. Every case must
be refused with an OpenAI-shaped 400 naming the field before anything reaches the engine (the
stub fails the test if something does). A handful of these also run end to end against a real
server in test_server.py."""
from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from pagedserve.config import EngineConfig
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.entrypoints.openai.api_server import build_app

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


class ValidationOnlyLLM:
    """What build_app needs of an AsyncLLM, without an engine: generating fails the test."""

    def __init__(self, model_dir: str) -> None:
        from pagedserve.model import loader

        self.tokenizer = loader.load_tokenizer(model_dir)
        hf = loader.load_config(model_dir)
        self.vocab_size = hf.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, hf.vocab_size, MAX_MODEL_LEN, {2})
        self.config = EngineConfig(max_model_len=MAX_MODEL_LEN)
        self.max_model_len = MAX_MODEL_LEN
        self.model_name = MODEL
        self.served_model_names = [MODEL, "alias"]
        self.loras: dict = {}  # LoRA adapters by name (none: --enable-lora is off)
        self.model_dir = model_dir
        from pagedserve.metrics import EngineMetrics

        self.metrics = EngineMetrics(MODEL)
        self.errored = False
        self.is_running = True
        self.reached_engine: list = []

    def num_waiting_to_start(self) -> int:
        return 0

    async def generate_processed(self, req):
        self.reached_engine.append(req)
        raise AssertionError(f"request {req.request_id} reached the engine")
        yield  # pragma: no cover

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def app_client(smollm2_dir):
    llm = ValidationOnlyLLM(smollm2_dir)
    with TestClient(build_app(llm)) as client:
        yield client, llm


USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}

BAD_REQUESTS = [
    # (path, body, expected param, words in message)
    ("/v1/completions", b'{"prompt": "hi", ', None, "JSON"),
    ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": "hello " * 3000}, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens", "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "n must be"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": [1, -3]}, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, "n", "n"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages", "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 3000}]}, "messages", "max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, "max_completion_tokens", "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1, "stream": True}, "temperature", "temperature"),
    # Found by a fresh-eyes review: each used to crash, hang or run away with the server.
    ("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 2}', "prompt", "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages", "surrogate"),
    ("/tokenize", b'{"prompt": "\\udfff"}', "prompt", "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1000000000, "max_tokens": 1}, "n", "at most"),
    ("/v1/completions", {"prompt": ["a"] * 300, "max_tokens": 1}, "n", "at most"),
    ("/v1/completions", {"prompt": "hi", "n": 100000, "max_tokens": 1}, "n", "n must be at most 128"),  # the cap it broke
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "chat_template": "{% for i in range(100000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}x"},
     "chat_template", "not allowed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10**7]}, "allowed_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids", "structured output"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 0], "min_tokens": 2, "stop_token_ids": [5, 0]}, "allowed_token_ids", "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5] * 60000}, "allowed_token_ids", "at most"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens", "greater than max_model_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hello " * 3000, "truncate_prompt_tokens": -1}, "prompt", "no room"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("/v1/completions", {"prompt": "hello " * 1900, "prompt_logprobs": 20, "n": 26, "max_tokens": 1}, "prompt_logprobs", "exceed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64 - 1, "n": 2, "stream": True}, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "temperature": "inf"}, "temperature", "finite"),
    # Structured output: compiled in the frontend, refused before the engine.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format", "invalid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {}}, "response_format", "needs a type"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice", "non-empty"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "response_format", "cannot both"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": "abc"}}, "structured_outputs", "list of non-empty strings"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "[" * 2000 + "]" * 2000}, "guided_json", "deeply"),
    # Issue 46: a regex ending in a lone backslash was answered with the backslash dropped.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "\\"}}, "structured_outputs", "lone trailing backslash"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "ab\\", "stream": True}, "guided_regex", "lone trailing backslash"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "ab\\"}, "guided_regex", "lone trailing backslash"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "ab\\\\\\"}, "stream": True}, "structured_outputs", "lone trailing backslash"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "ab\\"}}}}}}, "response_format", "/properties/a/pattern"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "object", "patternProperties": {"x\\": {"type": "integer"}}}}, "guided_json", "backslash"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": 'start: %json {"type": "string", "pattern": "ab\\\\"}'}, "guided_grammar", "backslash"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "\\"}}}}}], "tool_choice": "required", "stream": True}, "tools", "backslash"),
    # Tools: "auto" (the default with tools) needs the server flags, as in vLLM.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--enable-auto-tool-choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice", "tools` must be set"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                              "tool_choice": "required"}, "tools", "schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot both"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "allowed_token_ids": [5]}, "allowed_token_ids", "forced tool call"),
    # vLLM's priority needs --scheduling-policy priority (this app's engine is fcfs).
    ("/v1/completions", {"prompt": "hi", "priority": 1}, "priority", "--scheduling-policy priority"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -4}, "priority", "not enabled"),
    ("/v1/completions", {"prompt": "hi", "priority": 2**64}, "priority", "integer"),
    # Fields that would change the answer and are not implemented: refused, not silently ignored.
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions", "not supported"),
    ("/v1/completions", {"prompt": "hi", "length_penalty": 2.0}, "length_penalty", "not supported"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"] * 65}, "bad_words", "at most 64"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [""]}, "bad_words", "not empty"),
    ("/v1/completions", b'{"prompt": "hi", "bad_words": ["\\ud800"]}', "bad_words", "Unicode"),
    # Each sequence carries its own copy of the ban lists: their total per request is capped.
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": list(range(49152)), "n": 6}, "allowed_token_ids", "exceed"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e", "f"], "allowed_token_ids": list(range(49152))}, "allowed_token_ids", "exceed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "bad_words": ["\u0300" * 254 + chr(65 + i) for i in range(64)], "n": 5},
     "bad_words", "exceed"),
    ("/v1/completions", {"prompt": "hi", "bad_words": "x"}, "bad_words", "bad_words"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"], "guided_choice": ["x", "y"]}, "bad_words", "structured output"),
    # Amplification: every list-like or size-like field is capped.
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}, "stop", "at most 64"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 2000]}, "stop", "characters"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(1100))}, "stop_token_ids", "at most"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1100)}}, "logit_bias", "at most"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "at most"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens", "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "best_of": 50}, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "hi", "timeout": -1}, "timeout", "timeout"),
    # Found by the issue-10 review: a value that cannot travel to the engine-core process.
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64}, "top_k", "2**63"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**70, "stream": True}, "top_k", "2**63"),
    # Issue 46: tool results that answer no call, and loose types, were answered 200 (OpenAI: 400).
    ("/v1/chat/completions", {"messages": [USER, CALL, {"role": "tool", "content": "21 C"}]}, "messages[2].tool_call_id", "field required"),
    ("/v1/chat/completions", {"messages": [USER, CALL, {"role": "tool", "tool_call_id": "call_2", "content": "21 C"}]},
     "messages[2].tool_call_id", "no assistant tool call with id 'call_2'"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]},
     "messages[1].tool_call_id", "no assistant tool call comes before"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": "ok"}, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
     "messages[2].tool_call_id", "no assistant tool call comes before"),
    ("/tokenize", {"messages": [USER, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]}, "messages[1].tool_call_id", "comes before"),
    ("/v1/chat/completions", {"messages": [USER], "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": True}, "max_tokens", "valid integer"),
    ("/v1/chat/completions", {"messages": [USER], "logprobs": 1}, "logprobs", "valid boolean"),
    ("/v1/chat/completions", {"messages": [USER], "n": 2.0}, "n", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "echo": "true"}, "echo", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": [True, 5]}, "prompt[0]", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "no"}}, "stream_options.include_usage", "valid boolean"),
    ("/v1/responses", {"input": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": False}, "max_output_tokens", "valid integer"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "'wizard'"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "function", "name": "f", "content": "1"}]}, "messages[1].role", "'function'"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role", "role"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "'wizard'"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "valid string"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant"}]}, "messages[1].content", "content or tool_calls"),
    ("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": []}]}, "messages[1].content", "content or tool_calls"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_request_is_an_openai_400_naming_the_field(app_client, path, body, param, words):
    client, llm = app_client
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert words.lower() in err["message"].lower(), (words, err)
    assert err["param"] == param, (param, err)
    if param not in (None, "structured_outputs"):  # the message names what the client sent
        assert "structured_outputs" not in err["message"], err
    assert not llm.reached_engine


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "seed": -5},  # any int64 seed, as vLLM (clients send -1 for "random")
    {"prompt": "hi", "stream_options": {}},  # an empty object is no stream option
    {"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0},
    {"prompt": "hi", "prompt_logprobs": 2},
    *({"prompt": "hi", "guided_regex": rx} for rx in ("\\d+", "[a-z]+", "(ab|cd){2}", "a\\\\", "\\p{L}+", "a/b\\/")),
    {"prompt": "hi", "guided_json": {"type": "string", "pattern": "^a\\\\$"}},
])
def test_vllm_accepts_these_and_so_do_we(app_client, body):
    client, llm = app_client
    before = len(llm.reached_engine)
    try:
        client.post("/v1/completions", json=body)
    except AssertionError:  # the stub refuses to generate once the request got there
        pass
    assert len(llm.reached_engine) == before + 1
    llm.reached_engine.pop()


@pytest.mark.parametrize("body", [
    {"messages": [USER, CALL, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]},  # a tool round trip
    {"messages": [USER, {k: v for k, v in CALL.items() if k != "content"}, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                  {"role": "user", "content": "And tomorrow?"}]},  # no content key beside tool_calls
    {"messages": [{"role": "developer", "content": "Be brief."}, USER], "temperature": 1, "top_p": 1, "stream": True},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, USER, {"role": "assistant", "content": "Sunny."}],
     "continue_final_message": True, "add_generation_prompt": False, "n": None, "max_tokens": None},
])
def test_valid_chat_requests_reach_the_engine(app_client, body):
    client, llm = app_client
    before = len(llm.reached_engine)
    try:
        r = client.post("/v1/chat/completions", json=body)
    except AssertionError as e:  # the stub refuses to generate once the request got there
        assert "reached the engine" in str(e)
    else:
        assert r.status_code == 200 and body.get("stream"), r.text  # a stream's failure comes as an event
    assert len(llm.reached_engine) == before + 1
    llm.reached_engine.pop()


def test_developer_messages_render_as_system(app_client):
    client, _ = app_client
    ids = [client.post("/tokenize", json={"messages": [{"role": role, "content": "Be brief."}, USER]}).json()["tokens"]
           for role in ("developer", "system")]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "priority": -7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -7, "stream": True}),
])
def test_priority_reaches_the_engine_request_under_the_priority_policy(app_client, path, body):
    client, llm = app_client
    llm.input_processor.scheduling_policy = "priority"
    try:
        try:
            client.post(path, json=body)
        except AssertionError:  # the stub refuses to generate once the request got there
            pass
        assert [c.priority for c in llm.reached_engine.pop().children] == [-7]
    finally:
        llm.input_processor.scheduling_policy = "fcfs"


def test_unknown_model_is_404_and_aliases_answer(app_client):
    client, llm = app_client
    for path, body in (("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["param"] == "model"
    assert client.get("/v1/models/no-such-model").status_code == 404
    # A request never names a file: a path in "model" is just an unknown name.
    for name in ("../../etc/passwd", "/etc/passwd", "..%2F..%2Fetc%2Fpasswd"):
        r = client.post("/v1/completions", json={"model": name, "prompt": "hi"})
        assert r.status_code == 404 and "root:" not in r.text
        assert client.get(f"/v1/models/{name}").status_code == 404
    assert client.get("/v1/models/alias").json()["id"] == "alias"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "alias"]
    assert not llm.reached_engine


def test_cors_preflight_succeeds_out_of_the_box(app_client):
    client, _ = app_client
    r = client.options("/v1/chat/completions", headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_docs_page_assets_come_from_the_server_not_a_cdn(app_client):
    client, _ = app_client
    html = client.get("/docs").text
    assert "cdn.jsdelivr" not in html and "unpkg" not in html
    for asset in ("/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css"):
        assert asset in html
        r = client.get(asset)
        assert r.status_code == 200 and len(r.content) > 10_000, asset
    assert client.get("/redoc").status_code == 404  # not served: ReDoc fetches its logo from a CDN


def test_openapi_schema_says_what_is_accepted(app_client):
    """Issue 46: schemathesis found the schema looser than the validation (any role, no content,
    an empty prompt or messages, Responses without input were schema-valid, then refused)."""
    client, _ = app_client
    schema = client.get("/openapi.json").json()
    defs = schema["components"]["schemas"]

    def model(name):
        return next(v for k, v in defs.items() if k.split("-")[0] == name)

    messages = model("ChatCompletionRequest")["properties"]["messages"]
    assert messages["minItems"] == 1
    assert sorted(messages["items"]["discriminator"]["mapping"]) == ["assistant", "developer", "system", "tool", "user"]
    assert model("ToolMessage")["required"] == ["role", "content", "tool_call_id"]
    assert model("UserMessage")["required"] == ["role", "content"] and model("AssistantMessage")["required"] == ["role"]
    prompt = model("CompletionRequest")["properties"]["prompt"]["anyOf"]
    assert all(p.get("minItems") == 1 or p.get("minLength") == 1 for p in prompt)
    responses = model("ResponsesRequest")
    assert "input" in responses["required"] and {"type": "null"} not in responses["properties"]["input"]["anyOf"]


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"), (dict(top_p=0.0), "top_p"), (dict(temperature=float("nan")), "temperature"), (dict(seed=2**70), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"), (dict(logit_bias={1: 500}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"), (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_engine_refusals_name_their_field_where_they_are_raised(kwargs, param):
    """Issue 47: every refusal of SamplingParams is a RequestError whose param is set where it is
    raised (nothing is guessed from the message); it survives pickling; the front maps it to a
    400 with that param, any other ValueError to a 400 naming nothing, a dead engine to a 503."""
    import pickle

    from pagedserve.engine.async_llm import EngineDeadError
    from pagedserve.entrypoints.openai.http_common import APIError, api_error
    from pagedserve.sampling_params import RequestError, SamplingParams

    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(param)
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is RequestError and (again.message, again.param) == (e.value.message, param)
    err = api_error(e.value)
    assert (err.status_code, err.err_type, err.param, err.message) == (400, "BadRequestError", param, e.value.message)
    assert api_error(ValueError("top_p looks wrong")).param is None
    assert api_error(EngineDeadError("gone")).status_code == 503
    overload = APIError("busy", status_code=503, err_type="ServiceUnavailableError", headers={"Retry-After": "1"})
    assert api_error(overload) is overload and overload.response().headers["retry-after"] == "1"
