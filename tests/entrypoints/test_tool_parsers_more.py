"""The qwen3_coder, mistral and pythonic tool-call parsers (issue 51): recorded model outputs
parsed whole and streamed (cut at every boundary, character by character and at random: content
and each call's argument pieces concatenate to the whole parse, a call's id, type and name come
once, in its first delta, indexes count the calls), what stays content, the type conversion of
qwen3_coder's values, the fallback template's calls in each format, and end to end: servers
started with --enable-auto-tool-choice --tool-call-parser <name>, the model's answer forced to a
recorded output, read with the openai client, streamed and not."""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil

import pytest

from pagedserve.entrypoints.openai.server_args import ServerArgs
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedserve.entrypoints.openai.tool_parsers_qwen3_coder import convert_value
from pagedserve.entrypoints.openai.tools import ToolCallStream, ToolPlan


def _fn(name, **props):
    return {"type": "function", "function": {"name": name, "description": name.replace("_", " "),
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    _fn("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}, ratio={"type": "number"},
        unit={"type": "string", "enum": ["c", "f"]}),
    _fn("write_file", path={"type": "string"}, content={"type": "string"}, options={"type": "object"},
        tags={"type": "array", "items": {"type": "string"}}, size={"type": ["integer", "null"]}),
    _fn("get_time"),
]

CODE = 'def main():\n    print("hi <b>")\n\nif __name__ == "__main__":\n    main()'

# (parser, the model's text, content, [(name, arguments)])
CASES = [
    # Qwen3-Coder: content first, two blocks, typed values, a multi-line code value, an empty call.
    ("qwen3_coder",
     "I'll check the weather and write the file.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.25\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n</parameter>\n"
     f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=options>\n{{\"overwrite\": true, \"modes\": [\"a\", {{\"b\": null}}]}}\n"
     "</parameter>\n<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=size>\nnull\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "I'll check the weather and write the file.\n\n",
     [("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True, "ratio": 0.25}),
      ("write_file", {"path": "src/app.py", "content": CODE, "options": {"overwrite": True, "modes": ["a", {"b": None}]},
                      "tags": ["x", "y"], "size": None}),
      ("get_time", {})]),
    # Only a call; a value that is not its declared type stays text; an undeclared parameter is text.
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get_weather", {"days": "three", "note": "42"})]),
    # Without <tool_call> around the function, and without </parameter> before </function>.
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nOslo\n</function>", None, [("get_weather", {"city": "Oslo"})]),
    # Hermes JSON inside <tool_call> is not this format: content; so is text with a lone "<".
    ("qwen3_coder", 'a <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> b', 'a <tool_call>\n{"name": "get_time", '
     '"arguments": {}}\n</tool_call> b', []),
    ("qwen3_coder", "x < y and <tool_ but no call", "x < y and <tool_ but no call", []),
    # Cut by max_tokens inside the first value: no call yet, all of it is content.
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nPar", []),
    # Cut after an argument: the call keeps it; the rest is content.
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2",
     "\n<parameter=days>\n2", [("get_weather", {"city": "Paris"})]),
    # A second function that goes wrong: the first stands, the rest is content.
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n<function=get_weather\n</tool_call>",
     "\n<function=get_weather\n</tool_call>", [("get_time", {})]),
    # Found by fuzzing: spaces around a name are dropped, whole or fed in pieces (a newline alone
    # must not fail the name before its ">" comes); the cut last parameter is content.
    ("qwen3_coder", "<function=\nl><parameter=s><parameter=", "<parameter=", [("l", {"s": ""})]),
    # Mistral 7B v0.3: [TOOL_CALLS] and a JSON list (key order free, extra keys ignored, string arguments).
    ("mistral", 'Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "c", '
     '"days": 2}}, {"arguments": {"path": "a.txt", "options": {"mode": [1, 2.5, null]}}, "name": "write_file", "id": "aB3dE6gH9"}, '
     '{"name": "get_time", "arguments": "{}"}]',
     "Let me look.",
     [("get_weather", {"city": "Paris, France", "unit": "c", "days": 2}),
      ("write_file", {"path": "a.txt", "options": {"mode": [1, 2.5, None]}}), ("get_time", {})]),
    # Tokenizer v11+ (Mistral Small 3.2, Devstral): name[ARGS]{...}, several, with [CALL_ID] and without [ARGS].
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "metric": true}[TOOL_CALLS]write_file[ARGS]{"path": "x/\\u00e9t\\u00e9.md", '
     '"content": "# Title\\n\\n- [ ] todo {not json}", "options": {"nested": {"deep": [{"a": 1}]}}}'
     '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}',
     None,
     [("get_weather", {"city": "Lyon", "metric": True}),
      ("write_file", {"path": "x/été.md", "content": "# Title\n\n- [ ] todo {not json}", "options": {"nested": {"deep": [{"a": 1}]}}}),
      ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome"} Done.', " Done.", [("get_weather", {"city": "Rome"})]),
    # Malformed: prose after the token, an unquoted key, NaN, a list that is not of calls: content.
    ("mistral", "Sure [TOOL_CALLS] I cannot call that.", "Sure [TOOL_CALLS] I cannot call that.", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{city: Paris}", "[TOOL_CALLS]get_weather[ARGS]{city: Paris}", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"ratio": NaN}', '[TOOL_CALLS]get_weather[ARGS]{"ratio": NaN}', []),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{} [TOOL_CALLS] oops", " [TOOL_CALLS] oops", [("get_time", {})]),
    ("mistral", "[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("mistral", "No tools needed: [1, 2] and [TOOL_CALL", "No tools needed: [1, 2] and [TOOL_CALL", []),
    # Llama 3.2 pythonic: several calls, Python literals of every kind.
    ("pythonic", '[get_weather(city="San Francisco", days=-2, metric=True, ratio=1.5e-3, unit=\'f\'), write_file(path="a.py", '
     'content="""line 1\nline, (2)""", options={"k": (1, None, False), "s": \'it\\\'s\'}, tags=["a", "b,c"]), get_time()]',
     None,
     [("get_weather", {"city": "San Francisco", "days": -2, "metric": True, "ratio": 0.0015, "unit": "f"}),
      ("write_file", {"path": "a.py", "content": "line 1\nline, (2)", "options": {"k": [1, None, False], "s": "it's"}, "tags": ["a", "b,c"]}),
      ("get_time", {})]),
    # Llama 4: inside <|python_start|>...<|python_end|>, after some text; JSON spellings taken; a trailing comma.
    ("pythonic", 'Checking now. <|python_start|>[get_weather(city="Kyoto", metric=true, days=null,)]<|python_end|>', "Checking now. ",
     [("get_weather", {"city": "Kyoto", "metric": True, "days": None})]),
    # Not calls: a list of numbers, a markdown link, a name, code in an argument, a positional argument.
    ("pythonic", "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("pythonic", "[docs](https://example.com)", "[docs](https://example.com)", []),
    ("pythonic", "[get_weather(city=CITY)]", "[get_weather(city=CITY)]", []),
    ("pythonic", '[get_weather(city=__import__("os").system("true"))]', '[get_weather(city=__import__("os").system("true"))]', []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", "Call get_time() later.", "Call get_time() later.", []),
    # A second call that goes wrong: the first stands, the rest is content.
    ("pythonic", '[get_time(), get_weather(city=lambda: 1)]', ' get_weather(city=lambda: 1)]', [("get_time", {})]),
]

IDS = [f"{p}-{i}" for i, (p, *_) in enumerate(CASES)]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=IDS)
def test_parse_recorded_outputs(parser, text, content, calls):
    got_content, got = TOOL_PARSERS[parser].extract(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # The arguments are json.dumps of the dict: what every other path of the server sends.
    assert [c.arguments for c in got] == [json.dumps(a, ensure_ascii=False) for _, a in calls]


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]], list[int]]:
    """(content, [(name, arguments, id)], deltas per call) of ``pieces`` fed to a stream,
    checking each call's delta shape on the way."""
    stream = ToolCallStream(plan)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    calls: dict[int, list[str]] = {}
    counts: list[int] = []
    for d in deltas:
        assert not (d.content and d.tool_calls)
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.index == len(calls), "calls are numbered in order"
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, tc.function.arguments or "", tc.id]
                counts.append(0)
            else:
                assert tc.id is None and tc.type is None and tc.function.name is None, "id, type and name come once"
                calls[tc.index][1] += tc.function.arguments
            counts[tc.index] += 1
    return "".join(d.content or "" for d in deltas), [tuple(calls[i]) for i in sorted(calls)], counts


def _chunkings(text: str, rnd: random.Random):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(1, 30))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=IDS)
def test_streamed_pieces_concatenate_to_the_whole_parse(parser, text, content, calls):
    plan = ToolPlan("auto", TOOLS, parser=parser)
    whole_content, whole = plan.calls_from_text(text)
    rnd = random.Random(len(text))
    for pieces in _chunkings(text, rnd):
        got_content, got, _ = _stream(plan, pieces)
        assert got_content == (whole_content or ""), pieces
        assert [(n, a) for n, a, _ in got] == [(c.name, c.arguments) for c in whole], pieces
        assert len({i for *_, i in got}) == len(got)
        id_form = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
        assert all(re.fullmatch(id_form, i) for *_, i in got)


BIG = "1" * 4301  # past Python's 4,300-digit limit of int(str)
BIG_INT_TEXTS = [
    ("hermes", f'Sure. <tool_call>{{"name": "get_weather", "arguments": {{"days": {BIG}}}}}</tool_call>'),
    ("hermes", f'<tool_call>{{"name": "get_weather", "arguments": "{{\\"days\\": {BIG}}}"}}</tool_call>'),  # arguments as a string
    ("json", f'{{"name": "get_weather", "arguments": {{"days": {BIG}}}}}'),
    ("json", f'[{{"name": "get_time", "arguments": {{}}}}, {{"name": "get_weather", "parameters": {{"days": {BIG}}}}}]'),
    ("llama3_json", f'<|python_tag|>{{"name": "get_time", "parameters": {{}}}}; {{"name": "get_weather", "parameters": {{"days": {BIG}}}}}'),
    ("llama3_json", f'[{{"name": "get_weather", "parameters": {{"days": {BIG}}}}}]'),
]


@pytest.mark.parametrize("parser,text", BIG_INT_TEXTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BIG_INT_TEXTS)])
def test_an_integer_past_pythons_digit_limit_is_not_a_json_call(parser, text):
    """JSON holding an integer of 4,301 digits (json.loads raises a plain ValueError) is text the
    model wrote, not a call: content, whole and streamed, never an exception."""
    assert TOOL_PARSERS[parser].extract(text, TOOLS) == (text, [])
    plan = ToolPlan("auto", TOOLS, parser=parser)
    for pieces in ([text], list(text), [text[:4000], text[4000:]]):
        assert _stream(plan, pieces)[:2] == (text, []), parser


def test_qwen3_coder_an_integer_past_pythons_digit_limit_stays_text():
    """A value that does not fit its declared type stays text: 4,301 digits as an integer, a
    number, inside an object; whole and streamed alike."""
    text = (f"<tool_call>\n<function=get_weather>\n<parameter=days>\n{BIG}\n</parameter>\n<parameter=ratio>\n-{BIG}\n</parameter>\n"
            f"</function>\n</tool_call><tool_call>\n<function=write_file>\n<parameter=options>\n{{\"n\": {BIG}}}\n</parameter>\n"
            f"<parameter=size>\n{BIG}\n</parameter>\n</function>\n</tool_call>")
    want = [("get_weather", {"days": BIG, "ratio": "-" + BIG}), ("write_file", {"options": f'{{"n": {BIG}}}', "size": BIG})]
    content, calls = TOOL_PARSERS["qwen3_coder"].extract(text, TOOLS)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == want
    plan = ToolPlan("auto", TOOLS, parser="qwen3_coder")
    for pieces in ([text], list(text), [text[:100], text[100:5000], text[5000:]]):
        got_content, got, _ = _stream(plan, pieces)
        assert got_content == "" and [(n, a) for n, a, _ in got] == [(c.name, c.arguments) for c in calls]


def test_arguments_stream_as_they_parse():
    """Fed token by token, a call goes out with its first argument and each next argument is its
    own delta (not the whole call at the end); parallel calls get their own indexes."""
    multi = [c for c in CASES if len(c[3]) > 1]
    assert {c[0] for c in multi} == {"qwen3_coder", "mistral", "pythonic"}
    for parser, text, _, calls in multi:
        plan = ToolPlan("auto", TOOLS, parser=parser)
        tokens = re.findall(r"\w+|\W", text)
        _, got, counts = _stream(plan, tokens)
        assert len(got) == len(calls) and counts[0] >= len(calls[0][1]) > 1, (parser, counts)
        # single_call (parallel_tool_calls false): only the first call, all of its arguments.
        stream = ToolCallStream(plan, single_call=True)
        deltas = [d for p in tokens for d in stream.feed(p)] + stream.finish()
        tcs = [tc for d in deltas for tc in d.tool_calls or []]
        assert {tc.index for tc in tcs} == {0} and json.loads("".join(tc.function.arguments for tc in tcs)) == calls[0][1]


def test_qwen3_coder_values_follow_the_tools_schema():
    assert convert_value("12", {"type": "integer"}) == 12
    assert convert_value("-1.5", {"type": "number"}) == -1.5 and convert_value("2", {"type": "number"}) == 2
    assert convert_value("FALSE", {"type": "boolean"}) is False and convert_value("yes", {"type": "boolean"}) == "yes"
    assert convert_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert convert_value("{'a': (1, 2)}", {"type": "object"}) == {"a": [1, 2]}  # a Python literal
    assert convert_value("[1, 2]", {"type": "object"}) == "[1, 2]"  # not an object: the text
    assert convert_value("007", {"type": "string"}) == "007" and convert_value("null", {"type": "string"}) == "null"
    assert convert_value("None", {"type": "integer"}) is None
    assert convert_value("3", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 3
    assert convert_value("3", {"enum": [1, 3]}) == 3 and convert_value("x", {"enum": ["x"]}) == "x"
    assert convert_value("nan", {"type": "number"}) == "nan" and convert_value("1e999", {"type": "number"}) == "1e999"
    assert convert_value(" 5 ", None) == " 5 "  # undeclared: as written


def test_registry_flags_and_call_ids():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for name in ("qwen3_coder", "mistral", "pythonic"):
        args = ServerArgs.from_cli_args(parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name]))
        assert args.tool_call_parser == name
    assert ToolPlan("auto", TOOLS, parser="mistral").keeps_special_tokens
    assert not ToolPlan("required", TOOLS, parser="mistral").keeps_special_tokens
    assert not ToolPlan("auto", TOOLS, parser="qwen3_coder").keeps_special_tokens
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", ToolPlan("named", TOOLS, parser="mistral").new_call_id()) for _ in range(20))


PAST = [("get_weather", {"city": "Oslo", "days": 2, "metric": False}), ("write_file", {"path": "a b.txt", "tags": ["x"], "options": {"o": None}})]


@pytest.mark.parametrize("parser", ["qwen3_coder", "mistral", "pythonic"])
def test_fallback_template_renders_calls_the_parser_reads(smollm2_dir, parser):
    """For a model whose template ignores tools, the packaged template asks for the server's
    parser's format and renders past calls in it: they parse back to the same calls."""
    from pagedserve.entrypoints.openai.tools import tools_template
    from pagedserve.model.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    conv = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in PAST]},
            {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, chat_template=tools_template(), tools=TOOLS,
                                   tool_call_format=TOOL_PARSERS[parser].template_format)
    system, past = text.split("<|im_start|>assistant\n")[0], text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert {"qwen3_coder": "<function=", "mistral": "[TOOL_CALLS]", "pythonic": "Python list"}[parser] in system
    content, calls = TOOL_PARSERS[parser].extract(past, TOOLS)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == PAST


# -- end to end ----------------------------------------------------------------------------------

MISTRAL_TOKENS = ["[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def tool_model(tiny_model_factory, tmp_path_factory):
    """The tiny llama with SmolLM2's tokenizer plus Mistral's [TOOL_CALLS] and [ARGS] as special
    tokens (ids 49152 and 49153), as Mistral's tokenizers have them."""
    from transformers import AutoTokenizer

    src = tiny_model_factory("llama", vocab_size=49280)
    path = tmp_path_factory.mktemp("toolcalls")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_TOKENS})
    tok.save_pretrained(path)
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


E2E = {  # parser: (the forced answer, content, calls)
    "qwen3_coder": ("On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                    "On it.\n", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "metric": true}[TOOL_CALLS]get_time[ARGS]{}',
                None, [("get_weather", {"city": "Paris", "metric": True}), ("get_time", {})]),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time()]', None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
}


def test_served_parsers_end_to_end(tiny_llm):
    """One engine, a server per parser (--enable-auto-tool-choice --tool-call-parser NAME): the
    answer forced to the parser's format (a one-choice grammar) comes back as tool calls through
    the openai client, streamed and not; a named tool choice gets the parser's id style."""
    import openai
    from app_utils import kv_idle, serve

    cli = argparse.ArgumentParser()
    ServerArgs.add_cli_args(cli)
    tools = [_fn("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}), _fn("get_time")]
    msgs = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    for parser, (answer, content, calls) in E2E.items():
        server = ServerArgs.from_cli_args(cli.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", parser]))
        id_form = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
        with serve(tiny_llm, server) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            body = dict(model="tiny", messages=msgs, tools=tools, temperature=0, max_tokens=120,
                        extra_body={"structured_outputs": {"choice": [answer]}})
            out = client.chat.completions.create(**body).choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content == content, out
            assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == calls
            assert all(re.fullmatch(id_form, c.id) and c.type == "function" for c in out.message.tool_calls)
            got: dict[int, list] = {}
            streamed_content, finish = "", None
            for chunk in client.chat.completions.create(**body, stream=True):
                ch = chunk.choices[0]
                streamed_content += ch.delta.content or ""
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    if tc.index not in got:
                        got[tc.index] = [tc.id, tc.function.name, ""]
                    else:
                        assert tc.id is None and tc.function.name is None
                    got[tc.index][2] += tc.function.arguments or ""
            assert finish == "tool_calls" and streamed_content == (content or "")
            assert [(n, json.loads(a)) for _, n, a in got.values()] == calls
            assert all(re.fullmatch(id_form, i) for i, *_ in got.values())
            # A forced (named) call under this server: arguments "{}", the parser's ids.
            named = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=20,
                                                   tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
            assert [(c.function.name, c.function.arguments) for c in named.message.tool_calls] == [("get_time", "{}")]
            assert re.fullmatch(id_form, named.message.tool_calls[0].id)
    kv_idle(tiny_llm)


def test_served_mistral_keeps_its_special_token(tool_model):
    """[TOOL_CALLS] is a special token of Mistral's tokenizers: under the mistral parser with
    tools the answer is decoded with it (alone, it is content), as vLLM; without tools it is
    skipped as usual."""
    from app_utils import kv_idle, serve, tiny_async_llm

    llm = tiny_async_llm(tool_model)
    try:
        with serve(llm, ServerArgs(enable_auto_tool_choice=True, tool_call_parser="mistral")) as url:
            import httpx

            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"49152": 100}}
            with_tools = httpx.post(url + "/v1/chat/completions", json={**body, "tools": [_fn("get_time")]}, timeout=60).json()
            assert with_tools["choices"][0]["message"]["content"] == "[TOOL_CALLS]", with_tools
            plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
            assert plain["choices"][0]["message"]["content"] == "", plain
        kv_idle(llm)
    finally:
        llm.shutdown()
