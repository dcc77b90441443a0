"""The real `pagedserve serve` process shared by the server tests (one per test session),
and helpers to read its /metrics."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

try:
    import httpx
except ImportError:  # some environments ship only httpx2 (what the openai client uses there)
    import httpx2 as httpx
import openai
import pytest

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    """A free loopback port (the one helper every test that starts a server uses)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_PIDS: dict[str, int] = {}  # the session server's front process, by base URL


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # One intra-op thread: the test process (clients, the offline reference) shares the cores,
    # and oversubscribed OpenMP spin-waits make a 2-thread server many times slower.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PAGEDSERVE_API_KEY", None)
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory", "200000000", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--served-model-name", MODEL, "smol",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    SERVER_PIDS[base] = proc.pid
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=AUTH, timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(pagedserve:[a-z0-9_]+)(\{[^}]*\})?\s+(\S+)$', line)
        if m:
            labels = m.group(2) or ""
            reason = re.search(r'finished_reason="(\w+)"', labels)
            key = m.group(1) + (f"[{reason.group(1)}]" if reason else "")
            out[key] = float(m.group(3))
    return out


def wait_idle(base: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        if (
            m["pagedserve:num_requests_running"] == 0
            and m["pagedserve:num_requests_waiting"] == 0
            and m["pagedserve:kv_cache_usage_perc"] == 0
        ):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {m}")
        time.sleep(0.1)


def start_tiny_server(model: str, tmp_path, *args: str, new_session: bool = False, port: int | None = None):
    """``pagedserve serve MODEL`` on a free loopback port (or ``port``; float32, one thread, no API key) with
    its output in ``tmp_path/server.log``, once ``/health`` answers 200. Returns
    ``(proc, base_url, log_path)``; the caller stops ``proc`` (by pid, or its process group
    with ``new_session``)."""
    port = port or free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", *args]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return proc, base, log_path
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise

