"""Prefill/decode disaggregation when an instance dies: real processes on loopback (the tiny
float32 model, one torch thread each) behind ``pagedserve proxy``, one instance killed with
SIGKILL (its front and its engine core, by pid) at the moment that matters:

(a) the decode instance, while the prefill instance holds two prompts' blocks for it (the
    prefill side's reads are slowed by the test hook, so the decode side is still waiting);
(b) the prefill instance, mid-transfer (a read already served, its reply held back by the hook).

Each checks what the client sees through the proxy and how fast, and what is left: the
surviving instance's pool all free again, no process of the killed one, the survivor serving.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from server_utils import free_port, httpx, start_tiny_server
from test_pd_disagg import body, ids, metrics, wait_idle

pytestmark = pytest.mark.slow

LEASE_S = 4  # the prefill instance's kv_lease_s
TRANSFER_TIMEOUT_S = 3  # the decode instance's kv_transfer_timeout_s
SERVER_ARGS = ("--num-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "512")


class Instances:
    """Servers and a proxy started by one test; ``close()`` kills whatever is left, by pid."""

    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.cores: list[psutil.Process] = []

    def serve(self, model: str, name: str, kv: dict, http_port: int | None = None) -> tuple[subprocess.Popen, str]:
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        args = ["--kv-transfer-config", json.dumps(kv), *SERVER_ARGS]
        proc, base, _ = start_tiny_server(model, d, *args, **({"port": http_port} if http_port else {}))
        self.procs.append(proc)
        self.cores += psutil.Process(proc.pid).children(recursive=True)
        return proc, base

    def start(self, model: str, p_kv: dict, d_kv: dict, p_port: int | None = None) -> tuple:
        """A prefill and a decode instance and the proxy in front, all started side by side
        (start-up is most of a test's time). Returns (P's process, P's URL, D's process, D's URL, the proxy's URL)."""
        p_port, d_port, proxy_port = p_port or free_port(), free_port(), free_port()
        P, D, proxy = (f"http://127.0.0.1:{port}" for port in (p_port, d_port, proxy_port))
        with open(self.tmp / "proxy.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "proxy", "--prefill", P, "--decode", D,
                                     "--host", "127.0.0.1", "--port", str(proxy_port)], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        with ThreadPoolExecutor(2) as ex:
            (p_proc, _), (d_proc, _) = ex.map(lambda spec: self.serve(model, *spec), [("p", p_kv, p_port), ("d", d_kv, d_port)])
        until(lambda: proc.poll() is None and _health(proxy) == 200, 60, "the proxy healthy")
        return p_proc, P, d_proc, D, proxy

    def close(self) -> None:
        for p in [*self.procs, *self.cores]:
            try:
                p.send_signal(signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        for p in self.procs:
            p.wait(15)
        _gone(self.cores, 15)


def _gone(procs: list, timeout: float) -> list:
    """Waits until every process has exited (a zombie counts as gone); returns those left."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def kill_instance(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL an instance's front and engine core (by pid, together, as a lost host would);
    returns the processes, all of which must be gone within 10 s."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(procs) >= 2, procs  # the front and its engine core
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    proc.wait(10)
    assert not _gone(procs, 10)
    return procs


def _health(base: str) -> int | None:
    try:
        return httpx.get(base + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def until(cond, timeout: float, what: str) -> float:
    """Polls ``cond`` every 50 ms; returns when it holds (the time it took), fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def send(base: str, b: dict, out: dict, key: str) -> None:
    """One request through the proxy (streamed when ``b["stream"]``); ``out[key]`` = (status,
    JSON body or the stream's data lines, monotonic time the answer ended). Never raises."""
    try:
        if b.get("stream"):
            with httpx.stream("POST", base + "/v1/completions", json=b, timeout=60) as r:
                if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
                    r.read()
                    out[key] = (r.status_code, r.json(), time.monotonic())
                    return
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                out[key] = (r.status_code, events, time.monotonic())
        else:
            r = httpx.post(base + "/v1/completions", json=b, timeout=60)
            out[key] = (r.status_code, r.json(), time.monotonic())
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        out[key] = (None, repr(e), time.monotonic())


def start_requests(base: str, bodies: dict) -> tuple[list[threading.Thread], dict]:
    results: dict = {}
    threads = [threading.Thread(target=send, args=(base, b, results, k)) for k, b in bodies.items()]
    for t in threads:
        t.start()
    return threads, results


def form(result) -> str:
    return "an error event, then [DONE]" if isinstance(result[1], list) else f"HTTP {result[0]}"


def error_of(result) -> tuple[int, dict]:
    """(HTTP status or the error event's code, the OpenAI error object) of a failed answer."""
    status, data, _ = result
    if isinstance(data, list):  # a stream: its error event, then [DONE]
        assert status == 200 and data and data[-1] == "[DONE]", data
        errors = [json.loads(e)["error"] for e in data[:-1] if "error" in json.loads(e)]
        assert len(errors) == 1, data
        return errors[0]["code"], errors[0]
    assert isinstance(data, dict) and "error" in data, result
    return status, data["error"]


def answer_text(result) -> str:
    status, data, _ = result
    assert status == 200, result
    if isinstance(data, list):
        assert data[-1] == "[DONE]" and not any("error" in json.loads(e) for e in data[:-1]), data
        return "".join(c.get("text", "") for e in data[:-1] for c in json.loads(e)["choices"])
    return data["choices"][0]["text"]


@pytest.fixture
def instances(tmp_path):
    inst = Instances(tmp_path)
    try:
        yield inst
    finally:
        inst.close()


def test_decode_killed_while_prefill_holds_its_blocks(instances, tiny_model_factory, tmp_path, monkeypatch):
    fault = tmp_path / "fault"
    fault.write_text("delay=8")  # every read is answered 8 s late: the decode side is still waiting when it dies
    monkeypatch.setenv("PAGEDSERVE_KV_TEST_FAULT_FILE", str(fault))  # read by a producer only
    p_proc, P, d_proc, D, proxy = instances.start(tiny_model_factory("llama"), {"kv_role": "kv_producer", "kv_port": free_port(), "kv_lease_s": LEASE_S},
                                             {"kv_role": "kv_consumer", "kv_port": free_port(), "kv_transfer_timeout_s": 30})
    expired0 = metrics(P).get("pagedserve:kv_transfer_failures_total[lease_expired]", 0)

    threads, results = start_requests(proxy, {"json": body(ids(150, 1), 16), "stream": body(ids(150, 2), 16, stream=True)})
    # Both prompts are held on the prefill side (9 blocks each) and wait for their KV on the decode side.
    until(lambda: metrics(D)["pagedserve:num_requests_waiting"] == 2, 30, "both requests waiting for their KV on D")
    held = metrics(P)["pagedserve:kv_cache_usage_perc"]
    assert held > 0
    t_kill = time.monotonic()
    kill_instance(d_proc)
    for t in threads:
        t.join(30)
    for key, r in results.items():  # a clear error, at once
        code, err = error_of(r)
        assert code == 502 and err["type"] == "BadGatewayError" and "decode instance" in err["message"], (key, r)
    answered_s = max(r[2] for r in results.values()) - t_kill
    assert answered_s < 5, results
    # The prefill side frees both holds when their lease runs out (counted from the prefill's end).
    until(lambda: metrics(P)["pagedserve:kv_cache_usage_perc"] == 0, LEASE_S + 10, "P's pool free again")
    freed_s = time.monotonic() - t_kill
    m = wait_idle(P, 5)
    assert m["pagedserve:kv_transfer_failures_total[lease_expired]"] == expired0 + 2
    # The prefill instance serves on; the proxy reports the decode side gone and answers 502 at once.
    assert p_proc.poll() is None and all(p.poll() is None for p in instances.procs if p not in (p_proc, d_proc))
    r = httpx.post(P + "/v1/completions", json=body(ids(40, 3), 4), timeout=60)
    assert r.status_code == 200, r.text
    health = httpx.get(proxy + "/health", timeout=10)
    assert health.status_code == 503 and not health.json()["decode"][0]["healthy"], health.text
    t0 = time.monotonic()
    later: dict = {}
    send(proxy, body(ids(150, 4), 8), later, "later")
    code, err = error_of(later["later"])
    assert code == 502 and "no decode instance reachable" in err["message"], later
    later_s = later["later"][2] - t0
    later_freed_s = until(lambda: metrics(P)["pagedserve:kv_cache_usage_perc"] == 0, LEASE_S + 10, "P's pool free after the 502")
    print(f"\n(a) held {held:.1%} of P's pool; client errors {answered_s:.2f} s after the kill (stream: {form(results['stream'])}); P free {freed_s:.2f} s after it "
          f"(lease {LEASE_S} s); a later request: 502 in {later_s:.2f} s, P free {later_freed_s:.2f} s after it")


def test_prefill_killed_mid_transfer(instances, tiny_model_factory, tmp_path, monkeypatch):
    model = tiny_model_factory("llama")
    fault = tmp_path / "fault"
    fault.write_text("delay=30")  # a read's reply is held back: the kill lands while it is in flight
    monkeypatch.setenv("PAGEDSERVE_KV_TEST_FAULT_FILE", str(fault))  # read by a producer only
    p_http, p_kv = free_port(), free_port()
    p_cfg = {"kv_role": "kv_producer", "kv_port": p_kv}
    # peer_down_s longer than the test: a restarted prefill instance must not be taken for the dead one.
    p_proc, P, d_proc, D, proxy = instances.start(
        model, p_cfg, {"kv_role": "kv_consumer", "kv_port": free_port(), "kv_transfer_timeout_s": TRANSFER_TIMEOUT_S,
                       "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"peer_down_s": 120}}, p_http)
    sent0 = metrics(P)["pagedserve:kv_transfer_sent_tokens_total"]

    threads, results = start_requests(proxy, {"json": body(ids(150, 5), 16), "stream": body(ids(150, 6), 16, stream=True)})
    until(lambda: metrics(D)["pagedserve:num_requests_waiting"] == 2, 30, "both requests waiting for their KV on D")
    until(lambda: metrics(P)["pagedserve:kv_transfer_sent_tokens_total"] > sent0, 30, "a read served by P (its reply held back)")
    t_kill = time.monotonic()
    kill_instance(p_proc)
    for t in threads:
        t.join(TRANSFER_TIMEOUT_S + 30)
    for key, r in results.items():
        code, err = error_of(r)
        assert code == 503 and err["type"] == "ServiceUnavailableError" and "KV transfer from the prefill instance failed" in err["message"], (key, r)
    answered_s = max(r[2] for r in results.values()) - t_kill
    assert answered_s < TRANSFER_TIMEOUT_S + 5, results
    wait_idle(D, 10)  # the blocks reserved for the two loads are free
    freed_s = time.monotonic() - t_kill
    failures = {k: v for k, v in metrics(D).items() if k.startswith("pagedserve:kv_transfer_failures_total[")}
    # The decode instance serves on: directly, and through the proxy (which computes the prompt there).
    assert d_proc.poll() is None and all(p.poll() is None for p in instances.procs if p not in (p_proc, d_proc))
    want = httpx.post(D + "/v1/completions", json=body(ids(150, 7), 16), timeout=60)
    assert want.status_code == 200, want.text
    t0 = time.monotonic()
    fallback: dict = {}
    send(proxy, body(ids(150, 7), 16), fallback, "fallback")
    assert answer_text(fallback["fallback"]) == want.json()["choices"][0]["text"]
    fallback_s = fallback["fallback"][2] - t0
    # A prefill instance is back (same addresses, a new engine id): the next request moves its KV again.
    fault.write_text("")  # the new instance behaves
    _, P2 = instances.serve(model, "p2", p_cfg, p_http)
    assert P2 == P
    received0 = metrics(D)["pagedserve:kv_transfer_received_tokens_total"]
    b = body(ids(150, 8), 16)
    pd: dict = {}
    send(proxy, b, pd, "pd")
    assert answer_text(pd["pd"]) == httpx.post(D + "/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
    assert metrics(D)["pagedserve:kv_transfer_received_tokens_total"] - received0 == 144
    wait_idle(D, 10)
    wait_idle(P2, 10)
    print(f"\n(b) client errors {answered_s:.2f} s after the kill (kv_transfer_timeout_s {TRANSFER_TIMEOUT_S}; stream: {form(results['stream'])}); D free {freed_s:.2f} s "
          f"after it; failures {failures}; fallback answer in {fallback_s:.2f} s")
