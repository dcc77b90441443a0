"""Clients of an engine core that runs beside the frontend (vLLM v1's ``EngineCoreClient``).

Both speak the typed messages of :mod:`pagedserve.messages` (``(type, payload)`` pairs) and
offer the same calls: ``send(message)`` (never blocks), ``recv(timeout_s)`` (the core's next
message or None),
``is_alive()``, ``shutdown()``, and ``info`` (the core's :class:`EngineCoreInfo`).

* :class:`MPClient`: the core in its own process (``python -m pagedserve.engine.core_proc``),
  over two ZeroMQ PUSH/PULL sockets on IPC paths in a private temporary directory (loopback by
  nature), msgpack-encoded. The core's torch threads are set by
  ``EngineConfig.num_threads``; the frontend runs no torch work.
* :class:`ThreadClient`: the core in a thread of this process, over two queues (no encoding).
  For tests and for callers that want one process.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import EngineCoreInfo
from pagedserve.messages import CoreError
from pagedserve.messages import EngineCoreEventType as Event
from pagedserve.messages import EngineCoreRequestType as Req

Message = tuple  # (type, payload): see pagedserve.messages

logger = logging.getLogger("pagedserve")

STARTUP_TIMEOUT_S = 600.0


def _raise_core_error(kind: str, message: str) -> None:
    # ModelFileError and RequestError are ValueErrors: a bad model or config, not a crash.
    exc = {"ValueError": ValueError, "ModelFileError": ValueError, "RequestError": ValueError, "FileNotFoundError": FileNotFoundError}.get(
        kind, RuntimeError
    )
    raise exc(message if exc is not RuntimeError else f"engine core failed: {kind}: {message}")


class MPClient:
    """Starts the engine-core process and talks to it.

    Args (past the config): ``kv_events``: the core publishes prefix-cache events (a
    data-parallel replica); ``cpus``: pin the core process to these core ids; ``extra_env``:
    set in its environment;
    ``wait_ready=False`` returns once the process is started, and the caller calls
    :meth:`wait_ready` (the DP client starts its replicas side by side).

    Raises (from the constructor or ``wait_ready``): ValueError / FileNotFoundError when the
    core refuses the config or model; RuntimeError when it dies or does not get ready in time.
    """

    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        *,
        kv_events: bool = False,
        cpus: Optional[list[int]] = None,
        extra_env: Optional[dict[str, str]] = None,
        wait_ready: bool = True,
    ) -> None:
        import zmq

        from pagedserve import messages

        self._messages = messages
        self._zmq = zmq
        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")  # mode 0700: only this user
        self._ctx = zmq.Context()
        # No high-water mark: a send never blocks and never drops (ZeroMQ's default of 1000
        # queued messages would silently lose requests while the core is in a long step).
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(f"ipc://{self._dir}/input")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(f"ipc://{self._dir}/output")
        self._send_lock = threading.Lock()
        cmd = [
            sys.executable,
            "-m",
            "pagedserve.engine.core_proc",
            "--input-address",
            f"ipc://{self._dir}/input",
            "--output-address",
            f"ipc://{self._dir}/output",
            "--config-json",
            json.dumps(config.to_dict()),
            "--log-level",
            log_level,
        ]
        if kv_events:
            cmd.append("--kv-events")
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        env.update(extra_env or {})
        self.proc = subprocess.Popen(cmd, env=env)
        self._startup_timeout_s = startup_timeout_s
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> EngineCoreInfo:
        """Wait for the core's ready message; sets and returns ``info``. On failure the core
        is stopped and the error raised."""
        try:
            self.info = self._wait_ready(self._startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self.info

    def _wait_ready(self, timeout_s: float) -> EngineCoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.recv(0.2)
            if msg is None:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine core process exited with status {self.proc.returncode} during start-up")
                continue
            kind, payload = msg
            if kind is Event.READY:
                return payload
            if kind is Event.ERROR:
                self.proc.wait(10)
                _raise_core_error(payload.kind, payload.message)
        raise RuntimeError(f"engine core did not get ready within {timeout_s:.0f} s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: Message) -> None:
        """Queue a message (an :class:`EngineCoreRequestType` and its payload) for the core; never blocks. With no high-water mark a send to a
        connected core always queues; a PUSH socket whose peer is gone (the core died) would
        block forever, so the send is non-blocking and such a message is dropped (the output
        thread notices the death and fails every request).

        Raises:
            TypeError: a value the codec cannot encode (a bug in the caller's validation).
        """
        data = self._messages.encode(msg)
        with self._send_lock:
            if self._ctx.closed:
                return
            try:
                self._input.send(data, flags=self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:  # no connected core: it died, is_alive() says so
                logger.warning("pagedserve: engine core not connected; dropped a %s message", msg[0].name)
            except self._zmq.ZMQError:  # closed by shutdown: is_alive() says so
                pass

    def recv(self, timeout_s: Optional[float]) -> Optional[Message]:
        """The core's next message (an :class:`EngineCoreEventType` and its payload), or None
        after ``timeout_s``. Only one thread may call this. Raises ValueError on a message that
        is not the core's."""
        try:
            if not self._output.poll(None if timeout_s is None else int(timeout_s * 1000)):
                return None
            return self._messages.check(self._messages.decode(self._output.recv(copy=False).buffer), Event)
        except self._zmq.ZMQError:  # closed by shutdown
            return None

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout_s``, then kill it; idempotent."""
        if self.proc.poll() is None:
            self.send((Req.SHUTDOWN, None))
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        with self._send_lock:
            if not self._ctx.closed:
                self._input.close(linger=0)
                self._output.close(linger=0)
                self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class ThreadClient:
    """The same interface over an :class:`EngineCore` stepped by a thread of this process."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.engine.core import EngineCore

        self.core = EngineCore(config)
        self.info = self.core.info
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from pagedserve.engine.core_proc import run_busy_loop

        def recv(timeout_s: Optional[float]) -> Optional[Message]:
            try:
                return self._inbox.get_nowait() if timeout_s == 0 else self._inbox.get(timeout=timeout_s)
            except queue.Empty:
                return None

        try:
            run_busy_loop(self.core, recv, self._outbox.put)
        except BaseException as e:
            logger.exception("pagedserve engine core thread crashed")
            self._error = e
            self._outbox.put((Event.ERROR, CoreError(type(e).__name__, str(e))))
        finally:
            self.core.shutdown()

    @property
    def pid(self) -> int:
        return os.getpid()

    def send(self, msg: Message) -> None:
        self._inbox.put(msg)

    def recv(self, timeout_s: Optional[float]) -> Optional[Message]:
        try:
            return self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put((Req.SHUTDOWN, None))
            self._thread.join(timeout_s)
