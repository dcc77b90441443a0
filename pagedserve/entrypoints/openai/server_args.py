"""The flags of `pagedserve serve` that shape the HTTP front (the engine's are
:class:`pagedserve.config.EngineConfig`'s), with vLLM's names and defaults."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass
class ServerArgs:
    """How the OpenAI-compatible server answers (see docs/server.md).

    Attributes:
        api_key: every route but /health needs it (``metrics_public``: /metrics too is open).
        chat_template: a Jinja chat template, or the path of a file holding one; None = the
            model's.
        trust_request_chat_template: allow a ``chat_template`` field in requests (it runs as
            code in the server).
        enable_auto_tool_choice, tool_call_parser: ``tool_choice: "auto"`` and how calls are
            read from the model's text ("hermes", "json" or "llama3_json").
        reasoning_parser: "deepseek_r1" or "qwen3": chat answers split a thinking model's
            ``<think>`` text into ``reasoning_content`` (see ``reasoning``); None = off.
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS (FastAPI's
            middleware), vLLM's defaults: every origin, method and header.
        generation_config: "auto" (the model's generation_config.json gives the default
            sampling parameters of requests that do not set them), "vllm" (none), or a folder
            holding a generation_config.json.
        enable_log_requests: log each request's id, prompt length and sampling parameters.
        enable_request_id_headers: every response carries ``X-Request-Id`` (the request's
            own, else a new random hex), as vLLM's flag.
        uvicorn_log_level: uvicorn's own log level.
        max_queued_requests: requests admitted but not started (no output yet) beyond which a
            new one gets 503 with ``Retry-After`` at once; None = no limit.
        request_timeout: default deadline of a request (seconds; a request's ``timeout`` field
            overrides it); past it the request ends with finish_reason "timeout".
        shutdown_timeout: on SIGTERM, seconds the running requests get to finish while new
            ones are refused with 503.
        max_request_body_bytes, max_header_bytes: larger requests get 413 / 431.
        frontend_nice: once the engine's processes have started, the front's threads (HTTP,
            tokenizing, detokenizing) take this nice value (Linux; 0 = leave them), so that on
            saturated cores they yield to the engine's compute threads instead of preempting
            them mid step (see ``run_server.lower_thread_priority``).
        allow_runtime_lora_updating: serve POST /v1/load_lora_adapter and
            /v1/unload_lora_adapter (vLLM's routes; vLLM gates them with
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); needs the engine's ``--enable-lora``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    metrics_public: bool = False
    chat_template: Optional[str] = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    generation_config: str = "auto"
    enable_log_requests: bool = False
    enable_request_id_headers: bool = False
    uvicorn_log_level: str = "info"
    max_queued_requests: Optional[int] = None
    request_timeout: Optional[float] = None
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 32 << 20
    max_header_bytes: int = 64 << 10
    frontend_nice: int = 10
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: " + ", ".join(TOOL_PARSERS) + ")")
        for name in ("max_queued_requests", "request_timeout", "max_request_body_bytes", "max_header_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if not 0 <= self.frontend_nice <= 19:
            raise ValueError(f"--frontend-nice must be in [0, 19], got {self.frontend_nice}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        self.api_key = self.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None

    def chat_template_text(self) -> Optional[str]:
        """The template itself: a file's contents when ``chat_template`` names a file.

        Raises:
            ValueError: a path that looks like a file but cannot be read.
        """
        t = self.chat_template
        if t is None:
            return None
        if os.path.isfile(t):
            with open(t, encoding="utf-8") as fh:
                return fh.read()
        if "{" not in t and (t.endswith((".jinja", ".j2", ".txt")) or os.sep in t):
            raise ValueError(f"--chat-template {t!r}: no such file (and not an inline template)")
        return t

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("server")
        g.add_argument("--host", default="127.0.0.1")
        g.add_argument("--port", type=int, default=8000)
        g.add_argument("--api-key", default=None, help="require this key on every route but /health (Bearer or X-Api-Key; or set PAGEDSERVE_API_KEY)")
        g.add_argument("--metrics-public", action="store_true", help="with --api-key, leave /metrics open (for a scraper without the key)")
        g.add_argument("--chat-template", default=None, help="a Jinja chat template or the path of a file with one (default: the model's)")
        g.add_argument(
            "--trust-request-chat-template", action="store_true", help="allow a chat_template field in requests (it runs as code in the server)"
        )
        g.add_argument("--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto" (needs --tool-call-parser)')
        g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="how tool calls are read from the model's text")
        g.add_argument(
            "--reasoning-parser",
            default=None,
            choices=list(REASONING_PARSERS),
            help="split a thinking model's <think> text into the chat message's reasoning_content",
        )
        g.add_argument("--allowed-origins", nargs="+", default=["*"], help="CORS origins")
        g.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS methods")
        g.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS headers")
        g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
        g.add_argument("--generation-config", default="auto", help="auto (the model's sampling defaults), vllm (none) or a folder")
        g.add_argument("--enable-log-requests", action="store_true", help="log every request (id, prompt length, sampling parameters)")
        g.add_argument(
            "--enable-request-id-headers",
            action="store_true",
            help="answer every request with an X-Request-Id header (the request's own, else a new one)",
        )
        g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
        g.add_argument(
            "--max-queued-requests", type=int, default=None, help="beyond this many requests waiting to start, answer 503 with Retry-After"
        )
        g.add_argument(
            "--request-timeout", type=float, default=None, help="default deadline of a request in seconds (the request's timeout field overrides it)"
        )
        g.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests get to finish (new ones get 503)")
        g.add_argument("--max-request-body-bytes", type=int, default=32 << 20, help="larger bodies get 413")
        g.add_argument("--max-header-bytes", type=int, default=64 << 10, help="larger request headers get 431")
        g.add_argument(
            "--frontend-nice",
            type=int,
            default=10,
            help="nice value of the front's threads once the engine runs, so they yield the cores to its compute threads (0 = unchanged)",
        )
        g.add_argument(
            "--allow-runtime-lora-updating",
            action="store_true",
            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
