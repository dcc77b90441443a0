"""``pagedserve chat``: an interactive conversation, with the model in this process or with a
running server (``--url http://127.0.0.1:8000/v1``, as ``vllm chat --url``).

Commands: ``/reset`` starts a new conversation, ``/exit`` (or Ctrl-D) quits. Ctrl-C while an
answer streams stops that answer (its request is aborted) and keeps the conversation, the
partial answer included. Engine log lines stay out of the conversation (warnings and errors
only, unless ``--log-level`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterator, Optional

HELP = "pagedserve chat: /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer."


class LocalChat:
    """Answers from an :class:`LLM` in this process."""

    def __init__(self, llm, params) -> None:
        self.llm, self.params = llm, params
        self.request_id: Optional[str] = None

    def stream(self, history: list[dict]) -> Iterator[str]:
        engine = self.llm.llm_engine
        ids = self.llm.apply_chat_template(history)
        self.request_id = engine.add_request(None, {"prompt_token_ids": ids}, self.params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == self.request_id and out.outputs:
                    yield out.outputs[0].text
        self.request_id = None

    def stop(self) -> None:
        if self.request_id is not None:
            self.llm.llm_engine.abort_request(self.request_id)
            self.request_id = None


class ServerChat:
    """Answers from an OpenAI-compatible server (streamed; closing the stream aborts there)."""

    def __init__(self, url: str, api_key: Optional[str], model: Optional[str], args: argparse.Namespace) -> None:
        import httpx

        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(600, connect=10))
        try:
            self.model = model or self.http.get(self.base + "/models").json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ValueError(f"no OpenAI-compatible server answers at {self.base}: {e}") from None
        self.body = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.sampling_seed,
        }

    def stream(self, history: list[dict]) -> Iterator[str]:
        body = {"model": self.model, "messages": history, "stream": True, **self.body}
        with self.http.stream("POST", self.base + "/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(r.json().get("error", {}).get("message", r.text))
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise ValueError(chunk["error"]["message"])
                    if chunk.get("choices"):
                        yield chunk["choices"][0]["delta"].get("content") or ""

    def stop(self) -> None:
        pass  # leaving the stream closed the connection, which aborts the request


def run_chat(backend, system: Optional[str], read=input, write=sys.stdout) -> int:
    """The conversation loop over ``backend`` (``stream(history)``, ``stop()``)."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D to quit)", file=sys.stderr)
            continue
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            history = list(start)
            print("(new conversation)", file=sys.stderr)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        try:
            for piece in backend.stream(history):
                reply.append(piece)
                write.write(piece)
                write.flush()
        except KeyboardInterrupt:
            backend.stop()
            write.write(" [stopped]")
        except Exception as e:  # a refused request, or the server gone (httpx errors): keep the chat
            history.pop()
            print(f"\nerror: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        write.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0
