"""`pagedserve chat`: the conversation loop (Ctrl-C mid-answer, /reset, /exit) with a scripted
backend, the local engine without log lines in the conversation, and `--url` against the
session's real server."""
from __future__ import annotations

import io
import os
import subprocess
import sys

try:
    import httpx
except ImportError:  # some environments ship only httpx2 (as server_utils)
    import httpx2 as httpx

from pagedserve.entrypoints.chat_cli import run_chat
from server_utils import API_KEY, AUTH, MODEL


class ScriptedBackend:
    def __init__(self) -> None:
        self.seen: list[list[dict]] = []
        self.stopped = 0

    def stream(self, history):
        self.seen.append([dict(m) for m in history])
        if history[-1]["content"] == "down":
            raise ConnectionError("the server went away")  # e.g. httpx.ConnectError with --url
        yield "Hel"
        if history[-1]["content"] == "long":
            raise KeyboardInterrupt  # Ctrl-C while the answer streams
        yield "lo"

    def stop(self):
        self.stopped += 1


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation():
    lines = iter(["long", "down", "again", "/reset", "fresh", "/exit", "never read"])
    out = io.StringIO()
    backend = ScriptedBackend()
    assert run_chat(backend, "be brief", read=lambda _: next(lines), write=out) == 0
    assert backend.stopped == 1
    assert out.getvalue() == "Hel [stopped]\nHello\nHello\n"
    second, third = backend.seen[2], backend.seen[3]  # "down" failed and left no trace
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"] and second[2]["content"] == "Hel"
    assert [m["content"] for m in third] == ["be brief", "fresh"]  # /reset keeps only the system prompt


def _run(args, stdin, timeout=180):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_local_chat_has_no_log_lines_in_the_conversation(tiny_model_factory):
    r = _run(["--model", tiny_model_factory("llama"), "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
              "--max-tokens", "5"], "hi\n/reset\nhello\n/exit\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len([line for line in r.stdout.splitlines() if line.strip("> ")]) == 2
    assert "INFO" not in r.stderr and "/reset" in r.stderr


def test_chat_with_a_running_server(server):
    """The CLI prints the server's answer to the same request (greedy), whatever the model writes."""
    question = "What is the capital of France?"
    r = _run(["--url", server + "/v1", "--api-key", API_KEY, "--max-tokens", "8"], question + "\n/exit\n", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0.0}
    want = httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    assert want.strip() and r.stdout == f"> {want}\n> ", (r.stdout, want)  # input()'s prompts, the answer, /exit
    r = _run(["--url", "http://127.0.0.1:9"], "hi\n", timeout=60)  # nothing listens there
    assert r.returncode == 2 and "no OpenAI-compatible server" in r.stderr
