"""Rendering a chat template that came with a request (only with
``--trust-request-chat-template``). A template is a program, so it runs in Jinja's immutable
sandbox, in a separate process, under bounds on what it can cost:

* at most ``MAX_TEMPLATE_CHARS`` characters of template and ``MAX_OUTPUT_CHARS`` of output;
* ``range`` draws from one budget of ``MAX_LOOP_ITEMS`` items per render, so nested loops cannot
  multiply into billions of iterations (Jinja caps each range at 100,000 but not their product);
* ``RENDER_TIMEOUT_S`` seconds of wall time, counted from when the render process says it is
  ready (not its start, which runs at the front's lowered priority); past it the render
  process is killed (and started again for the next template); loops over long strings,
  ``'x' * 10**9``, ``10**10**10`` or a filter like ``center(10**9)`` end there or at the
  process's ``MEMORY_LIMIT_BYTES`` address space limit, never in the server.

The render process (``python -m pagedserve.entrypoints.openai.chat_template``) imports only
Jinja and speaks JSON lines over its stdin/stdout: nothing from it is unpickled. The server's
own template (the model's, or ``--chat-template``) is trusted and rendered by transformers.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
from typing import Any, Optional

MAX_TEMPLATE_CHARS = 64_000
MAX_LOOP_ITEMS = 100_000
MAX_OUTPUT_CHARS = 1_000_000
RENDER_TIMEOUT_S = 2.0
STARTUP_TIMEOUT_S = 30.0  # the render process's start (Python, Jinja) is not the template's time
MEMORY_LIMIT_BYTES = 1 << 30


class TemplateLimitError(ValueError):
    """A bound (size, loop items, output, time, memory) was hit."""


class TemplateSandbox:
    """One long-lived render process, started on first use; renders one template at a time."""

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        return subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=package_root
        )

    def render(self, job: dict[str, Any]) -> str:
        """Render ``job`` (see :func:`_render`'s keywords) in the render process.

        Raises:
            TemplateLimitError: a bound was hit; ValueError: the template failed (its message).
        """
        if len(job["template"]) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(f"chat_template is {len(job['template'])} characters, more than {MAX_TEMPLATE_CHARS}")
        line = (json.dumps(job) + "\n").encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
                if self._read_line(self._proc, STARTUP_TIMEOUT_S) is None:  # its "ready" line
                    self._kill()
                    raise RuntimeError("the chat template render process did not start")
            proc = self._proc
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                reply = self._read_line(proc, self.timeout_s)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:  # timed out, or died (memory limit): kill it, start anew next time
                self._kill()
                raise TemplateLimitError(f"chat_template took more than {self.timeout_s:g} s or {MEMORY_LIMIT_BYTES >> 20} MiB to render")
        out = json.loads(reply)
        if "text" in out:
            return out["text"]
        raise (TemplateLimitError if out.get("limit") else ValueError)(out["error"])

    def _read_line(self, proc: subprocess.Popen, timeout_s: float) -> Optional[bytes]:
        import time

        deadline = time.monotonic() + timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not buf.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    return None
                buf += chunk
        return buf

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                f.close()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()


_SANDBOX = TemplateSandbox()
atexit.register(_SANDBOX.close)


def render_untrusted(
    template: str, conversation: list[dict], tokenizer: Any, add_generation_prompt: bool, continue_final_message: bool, **kwargs: Any
) -> str:
    """The prompt text ``template`` makes of ``conversation`` (rendered in the render process).

    Raises:
        TemplateLimitError: a bound was hit; ValueError: the template failed (its message).
    """
    return _SANDBOX.render(
        dict(
            template=template,
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            kwargs=kwargs,
        )
    )


def _render(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    continue_final_message: bool,
    bos_token: str,
    eos_token: str,
    kwargs: dict[str, Any],
) -> str:
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    budget = [MAX_LOOP_ITEMS]

    def bounded_range(*args: int) -> range:
        r = range(*args)
        budget[0] -= len(r)
        if budget[0] < 0:
            raise TemplateLimitError(f"chat_template loops over more than {MAX_LOOP_ITEMS} items")
        return r

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(range=bounded_range, raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    pieces, size = [], 0
    for piece in env.from_string(template).generate(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token, **kwargs
    ):
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"chat_template output is over {MAX_OUTPUT_CHARS} characters")
        pieces.append(piece)
    text = "".join(pieces)
    if continue_final_message and messages and isinstance(messages[-1].get("content"), str) and messages[-1]["content"]:
        final = messages[-1]["content"]
        cut = text.rfind(final)
        if cut >= 0:
            text = text[: cut + len(final)]
    return text


def _serve() -> None:
    """The render process: one JSON job per stdin line, one JSON answer per stdout line."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    import jinja2
    import jinja2.sandbox  # noqa: F401  (imported before the first job's clock starts)

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            out = {"text": _render(**json.loads(line))}
        except TemplateLimitError as e:
            out = {"error": str(e), "limit": True}
        except MemoryError:
            out = {"error": f"chat_template needed more than {MEMORY_LIMIT_BYTES >> 20} MiB", "limit": True}
        except (jinja2.TemplateError, ValueError, TypeError, OverflowError, KeyError, AttributeError, RecursionError) as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
