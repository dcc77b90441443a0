"""``tools`` and ``tool_choice`` of /v1/chat/completions, as vLLM implements them:

* ``"none"``: the tools are rendered into the prompt, the answer is plain content;
* ``"auto"`` (the default when tools are given): the model decides; its answer is split into
  content and calls by the server's ``--tool-call-parser``. Needs ``--enable-auto-tool-choice``;
  without it the request is a 400 that names the flag;
* ``"required"``: the grammar forces a JSON list of one or more ``{"name", "parameters"}``
  objects, each valid against its function's schema;
* ``{"type": "function", "function": {"name": ...}}``: the grammar forces that function's
  arguments (its ``parameters`` schema).

A function without ``parameters`` (or with ``{}``) takes none: its forced arguments are ``{}``.

Tools in the conversation, as chat templates take them: an assistant message's tool calls with
their arguments as dicts (:func:`tool_call_for_template`), each tool result answering a call
made before it (:func:`check_answers_a_call`), and the ChatML + Hermes tool-call template used
when the model's own template does not render tools (:func:`tools_template`).

Every refusal is the front's :class:`APIError` (400) naming ``tools``, ``tool_choice`` or the
message at fault.

Every call gets an id ``chatcmpl-tool-<hex>`` (under ``--tool-call-parser mistral``: 9 letters
and digits, the ids Mistral's templates take back); a response with calls finishes with
``"tool_calls"``, or ``"stop"`` for a forced named function (as OpenAI and vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

from pagedserve.entrypoints.openai.http_common import APIError, random_id
from pagedserve.entrypoints.openai.tool_parser_base import ToolCallDelta
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall
from pagedserve.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128  # tools of one request (each is rendered into the prompt and compiled)


def random_tool_call_id() -> str:
    return random_id("chatcmpl-tool-")


def tool_call_for_template(call: Any, i: int) -> dict:
    """An assistant message's tool call as chat templates expect it: arguments as a dict."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"messages[{i}].tool_calls: each call needs function.name.", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise APIError(f"messages[{i}].tool_calls: function.arguments is not JSON.", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def check_answers_a_call(call_id: str, call_ids: set[str], field: str, param: str, call: str) -> None:
    """A tool result must answer a call made before it (OpenAI's 400): ``call_ids`` holds the ids
    of the calls so far, ``field`` names the result's id in the message, ``call`` what a call is
    called in this API.

    Raises:
        APIError: naming ``field``, with ``param``.
    """
    if call_id in call_ids:
        return
    if not call_ids:
        raise APIError(f"{field}: no {call} comes before this tool result.", param=param)
    raise APIError(f"{field}: no {call} with id {call_id!r} comes before it.", param=param)


@lru_cache(maxsize=1)
def tools_template() -> str:
    """ChatML with Hermes tool calls (``templates/chatml_hermes_tools.jinja``), used when tools are
    given and the chat template does not render them; with the template variable
    ``tool_call_format="json"`` (the json and llama3_json parsers) calls are bare JSON."""
    import importlib.resources

    return importlib.resources.files("pagedserve.entrypoints.openai").joinpath("templates/chatml_hermes_tools.jinja").read_text()


@dataclass
class ToolPlan:
    """How one request uses its tools.

    Attributes:
        mode: "none", "auto", "required" or "named".
        named: the forced function's name (mode "named").
        constraint: the grammar of "required" / "named".
        parser: the server's tool-call parser name (it parses the calls of mode "auto"; in
            every mode it makes the calls' ids).
    """

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)
    named: Optional[str] = None
    constraint: Optional[StructuredOutputsParams] = None
    parser: Optional[str] = None

    @property
    def calls_finish_reason(self) -> str:
        """A choice's finish_reason when it ends with calls: ``"stop"`` for a forced named
        function, as OpenAI and vLLM answer; ``"tool_calls"`` when the model chose to call."""
        return "stop" if self.mode == "named" else "tool_calls"

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def new_call_id(self) -> str:
        return TOOL_PARSERS[self.parser].new_call_id() if self.parser in TOOL_PARSERS else random_tool_call_id()

    @property
    def keeps_special_tokens(self) -> bool:
        """Mode "auto" with a parser whose markers are special tokens (``mistral``'s
        ``[TOOL_CALLS]``): the answer must be decoded with them, as vLLM's adjust_request."""
        return self.mode == "auto" and self.parser in TOOL_PARSERS and TOOL_PARSERS[self.parser].keeps_special_tokens

    def calls_from_text(self, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
        """(content, calls) of a finished answer."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ParsedToolCall(o["name"], json.dumps(o.get("parameters", {}), ensure_ascii=False)) for o in items]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # cut by length: not a complete list
        if self.mode == "auto":
            return TOOL_PARSERS[self.parser].extract(text, self.tools)
        return text, []


def plan_tools(
    tools: Optional[list[dict[str, Any]]], tool_choice: Any, enable_auto: bool, parser: Optional[str], parallel_tool_calls: Optional[bool] = None
) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` and decide the mode (``parallel_tool_calls=False``: a
    "required" answer holds exactly one call).

    Raises:
        APIError: naming ``tools`` or ``tool_choice`` (malformed, unknown function, "auto"
            without ``--enable-auto-tool-choice``).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return ToolPlan()
    if len(tools) > MAX_TOOLS:
        raise APIError(f"at most {MAX_TOOLS} tools are allowed per request, got {len(tools)}.", param="tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}.", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object.", param="tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise APIError("tools must have distinct function names.", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    # No parameters (omitted or {}): an empty parameter list, as OpenAI documents and vLLM
    # compiles it; closed by close_objects, so the only arguments are "{}".
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in tools}
    if choice == "none":
        return ToolPlan("none", tools, parser=parser)
    if choice == "auto":
        if not enable_auto or parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.', param="tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        defs: dict[str, Any] = {}
        branches = []
        for n, schema in schemas.items():
            schema = dict(schema)
            for key in ("$defs", "definitions"):  # "#/$defs/X" must resolve at the wrapper's root
                for name, d in (schema.pop(key, None) or {}).items():
                    if defs.setdefault(f"{key}/{name}", d) != d:
                        raise APIError(f"tools define {key}/{name} differently; give the shared definitions one meaning.", param="tools")
            branches.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
        if parallel_tool_calls is False:
            array["maxItems"] = 1
        for path, d in defs.items():
            key, name = path.split("/", 1)
            array.setdefault(key, {})[name] = d
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=array), parser=parser)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise APIError(f"tool_choice names the function {name!r}, which is not in tools.", param="tool_choice")
        return ToolPlan("named", tools, named=name, constraint=StructuredOutputsParams(json=schemas[name]), parser=parser)
    raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.', param="tool_choice")


class ToolCallStream:
    """One streamed choice under a :class:`ToolPlan`: text deltas in, ``DeltaMessage``s out,
    whose content and tool calls concatenate to what ``calls_from_text`` gives at the end.

    A parser's stream gives whole calls (:class:`ParsedToolCall`: one delta with the call's
    index, id, name and arguments) or pieces (:class:`ToolCallDelta`: the first, with the name,
    opens the call as above; each next one is a delta with only the index and more arguments)."""

    def __init__(self, plan: ToolPlan, single_call: bool = False) -> None:
        self.plan = plan
        self.single_call = single_call
        self.num_calls = 0
        self.text: list[str] = []
        self.parser = TOOL_PARSERS[plan.parser].streaming(plan.tools) if plan.mode == "auto" else None
        self.dropping = False  # the pieces of a call beyond single_call's first
        self.named_id: Optional[str] = None
        self.held = ""  # whitespace-only content not sent yet
        self.sent_text = False

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _calls(self, calls: list) -> list:
        from pagedserve.entrypoints.openai.protocol_responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall

        out = []
        for c in calls:
            if isinstance(c, ToolCallDelta) and c.name is None:  # more arguments of the last call
                if self.num_calls and not self.dropping and c.arguments:
                    delta = DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=c.arguments))
                    out.append(DeltaMessage(tool_calls=[delta]))
                continue
            if self.single_call and self.num_calls:
                self.dropping = True
                continue
            out.append(
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(
                            index=self.num_calls,
                            id=self.plan.new_call_id(),
                            type="function",
                            function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                        )
                    ]
                )
            )
            self.num_calls += 1
        return out

    def feed(self, text: str) -> list:
        from pagedserve.entrypoints.openai.protocol_responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall

        if not text:
            return []
        mode = self.plan.mode
        if mode == "named":  # the arguments stream as they are generated
            if self.named_id is None:
                self.named_id = self.plan.new_call_id()
                self.num_calls = 1
                return [
                    DeltaMessage(
                        tool_calls=[
                            DeltaToolCall(
                                index=0, id=self.named_id, type="function", function=DeltaFunctionCall(name=self.plan.named, arguments=text)
                            )
                        ]
                    )
                ]
            return [DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))])]
        if mode == "required":
            self.text.append(text)  # a JSON list: sent whole once complete
            return []
        if mode == "auto":
            content, calls = self.parser.feed(text)
            return self._content(content) + self._calls(calls)
        return [DeltaMessage(content=text)]

    def _content(self, content: str) -> list:
        """Content deltas of "auto". Whitespace before any real text is held back: with calls, an
        answer of only whitespace around them has no content (as ``calls_from_text`` says);
        without calls it is sent at the end."""
        from pagedserve.entrypoints.openai.protocol_responses import DeltaMessage

        self.held += content
        if not self.held or (not self.sent_text and not self.held.strip()):
            return []
        out, self.held = self.held, ""
        self.sent_text = True
        return [DeltaMessage(content=out)]

    def finish(self) -> list:
        from pagedserve.entrypoints.openai.protocol_responses import DeltaMessage

        if self.plan.mode == "required":
            content, calls = self.plan.calls_from_text("".join(self.text))
            return ([DeltaMessage(content=content)] if content else []) + self._calls(calls)
        if self.plan.mode == "auto":
            content, calls = self.parser.finish()
            out = self._content(content) + self._calls(calls)
            if self.held and not self.called:
                out.insert(0, DeltaMessage(content=self.held))
            self.held = ""
            return out
        return []
