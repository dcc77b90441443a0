"""The ``pagedserve`` command: generate, chat, serve, proxy, bench, cache, explain."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.openai.server_args import ServerArgs


def _make_llm(args: argparse.Namespace):
    from pagedserve.entrypoints.llm import LLM

    return LLM(**EngineConfig.from_cli_args(args).to_dict())


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _params(args)
    if args.raw:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.chat_cli import LocalChat, ServerChat, run_chat
    from pagedserve.sampling_params import RequestOutputKind

    if args.url:
        backend = ServerChat(args.url, args.api_key, args.model, args)
    else:
        params = _params(args)
        params.output_kind = RequestOutputKind.DELTA
        backend = LocalChat(_make_llm(args), params)
    return run_chat(backend, args.system)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.openai.run_server import run_server

    return run_server(args) or 0


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (the usage of an engine command is dozens of lines); subcommand
    parsers take this class too (argparse's ``add_subparsers`` default)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _command_of(argv: list[str]) -> Optional[str]:
    """The subcommand named in ``argv`` (the first word that is no option or --log-level's value)."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--log-level":
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The CLI's parser; ``only="serve"`` builds that command alone (a server's front then
    never imports the benchmark modules, which bring torch)."""
    parser = _Parser(prog="pagedserve", description="pagedserve: paged-KV LLM inference and serving")
    parser.add_argument("--log-level", default="info")
    # --log-level after the subcommand too (pagedserve serve --log-level debug), as vLLM takes it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, help="debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", required=True)
    if only == "serve":
        _add_serve_parser(sub, common)
        return parser

    g = sub.add_parser("generate", parents=[common], help="answer one prompt (through the chat template unless --raw)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="complete the prompt as plain text, no chat template")
    _sampling_args(g)
    EngineConfig.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", parents=[common], help="interactive chat that keeps the conversation")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--url", default=None, help="talk to a running server instead (e.g. http://127.0.0.1:8000/v1)")
    c.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    _sampling_args(c)
    EngineConfig.add_cli_args(c)
    c.set_defaults(func=cmd_chat)

    _add_serve_parser(sub, common)

    from pagedserve.entrypoints.proxy import add_proxy_args, cmd_proxy

    x = sub.add_parser(
        "proxy", parents=[common], help="prefill/decode disaggregation proxy in front of kv_producer and kv_consumer instances (experimental)"
    )
    add_proxy_args(x)
    x.set_defaults(func=cmd_proxy)

    from pagedserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from pagedserve.entrypoints.cache_cli import add_cache_parser

    add_cache_parser(sub)

    from pagedserve.entrypoints.explain import add_explain_parser

    add_explain_parser(sub).add_argument("--log-level", default=argparse.SUPPRESS, help="debug, info, warning, error")
    return parser


def _add_serve_parser(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP server")
    s.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct; --model works too)",
    )
    ServerArgs.add_cli_args(s)
    EngineConfig.add_cli_args(s, usage="serve")
    s.set_defaults(func=cmd_serve)


def main(argv: Optional[list[str]] = None) -> int:
    words = argv if argv is not None else sys.argv[1:]
    command = _command_of(words)
    if command == "serve":  # the engine core runs in its own process: this front needs no torch
        from pagedserve import platform

        platform.block_torch_import()
    parser = build_parser(only="serve" if command == "serve" else None)
    args = parser.parse_args(argv)
    explicit = any(a == "--log-level" or a.startswith("--log-level=") for a in words)
    # Keep the conversation, and explain's step table, clean.
    level = "warning" if args.command in ("chat", "explain") and not explicit else args.log_level
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad flags, model path, prompt: one line, no traceback
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
