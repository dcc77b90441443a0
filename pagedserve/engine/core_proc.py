"""The engine core's busy loop, and the main of the engine-core process
(``python -m pagedserve.engine.core_proc``, started by :class:`pagedserve.engine.core_client.MPClient`).

Messages (:mod:`pagedserve.messages`): in, an :class:`EngineCoreRequestType` with its payload
(ADD, ABORT, RELEASE_KV, UTILITY, SHUTDOWN); out, an :class:`EngineCoreEventType`: READY with the
:class:`EngineCoreInfo` once loaded, OUTPUTS after every step (and after commands that changed
the state of an idle core), UTILITY answers, and ERROR when start-up or a step fails (the
process then exits with status 1).

The loop: take every waiting command, run one step if any request is unfinished, send its
outputs; when idle, block on the next command (waking every second). Each pass checks that the
parent process is still there, so a core whose frontend died (even by SIGKILL) exits after at
most one step and removes the front's socket directory. A malformed message is logged and
dropped, never fatal.

Also here, :func:`freeze_gc_heap`: the collector's start-up freeze of a serving process (this
one and the server's front).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional

from pagedserve.core.outputs import EngineCoreOutput, EngineCoreOutputs
from pagedserve.messages import CoreError, UtilityResult
from pagedserve.messages import EngineCoreEventType as Event
from pagedserve.messages import EngineCoreRequestType as Req

Message = tuple  # (type, payload): see pagedserve.messages

logger = logging.getLogger("pagedserve")

IDLE_POLL_S = 1.0
UTILITIES = ("reset_prefix_cache", "get_stats", "get_step_trace", "get_block_map", "add_lora", "remove_lora", "list_loras")


def freeze_gc_heap() -> int:
    """Short garbage-collector pauses in a serving process: collect now (garbage must not be
    frozen: it would never be freed), then freeze every object still alive. Returns how many
    objects are frozen in this process.

    After start-up a process holds a few hundred thousand long-lived objects (modules, torch
    modules, the tokenizer). Python's full collection walks every one of them: during a W1 run
    over HTTP it paused the engine core for 217 ms in the middle of a step and the server's front
    for 194 ms (docs/perf-history.md, "the collector's pauses"). ``gc.freeze()`` moves what is
    alive to a permanent generation that collections skip, so a later full collection walks only
    what was made since. vLLM does the same once a server has started (``freeze_gc_heap`` in
    ``vllm/utils/gc_utils.py``).

    Called by the engine-core process and the server's front once they are ready; not by
    ``LLM``, whose process is the caller's (and whose offline runs measured no full collection).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_busy_loop(
    core: Any,
    recv: Callable[[Optional[float]], Optional[Message]],
    send: Callable[[Message], None],
    parent_alive: Callable[[], bool] = lambda: True,
    kv_events: bool = False,
) -> None:
    """Serve ``core`` (an :class:`EngineCore`) until a shutdown message or the parent's death.

    ``recv(timeout_s)`` returns the next (type, payload) or None after the timeout (0 = poll);
    ``send(message)`` must not block for long. Exceptions from a step propagate. With
    ``kv_events`` (a data-parallel replica) every outputs message carries the prefix-cache
    events since the previous one.
    """
    if kv_events:
        core.enable_kv_events()
    poll = getattr(core, "poll_interval", lambda: 0.0 if core.has_unfinished_requests() else None)
    last_key = None
    while True:
        wait = poll()
        msg = recv(IDLE_POLL_S if wait is None else wait)
        if not parent_alive():
            logger.warning("pagedserve engine core: the frontend process is gone; exiting")
            return
        if msg is None and wait is None:
            continue
        changed = False
        while msg is not None:
            if msg[0] is Req.SHUTDOWN:
                return
            changed |= _handle(core, msg, send)
            msg = recv(0.0)
        if core.has_unfinished_requests() or poll() is not None:
            out = core.step()
            if kv_events:
                out.kv_events = core.take_kv_events()
            # A step that only polled KV transfers and changed nothing is not worth a message.
            key = _stats_key(out)
            worth = out.outputs or out.num_scheduled_tokens or changed or key != last_key or out.scheduler_stats.kv_transfer_seconds or out.kv_events
            last_key = key
            if not worth:
                continue
        elif changed:
            out = EngineCoreOutputs([], time.monotonic(), core.get_stats())
            if kv_events:
                out.kv_events = core.take_kv_events()
        else:
            continue
        send((Event.OUTPUTS, out))


def _stats_key(outputs: EngineCoreOutputs) -> Optional[tuple]:
    """What a front would see change in a step's stats (blocks, queues, KV-transfer counters)."""
    s = outputs.scheduler_stats
    if s is None:
        return None
    return (
        s.num_free_blocks,
        s.num_waiting,
        s.num_running,
        s.kv_transfer_sent_tokens,
        s.kv_transfer_received_tokens,
        sum(s.kv_transfer_failures.values()),
    )


def _handle(core: Any, msg: Message, send: Callable[[Message], None]) -> bool:
    """Apply one command; returns True when it may have changed the core's state."""
    kind, payload = msg
    if kind is Req.ADD:
        for req in payload.requests:
            try:
                core.add_request(req)
            except ValueError as e:  # the frontend checks ids first; answer instead of dying
                logger.error("pagedserve engine core refused %s: %s", req.request_id, e)
                send((Event.OUTPUTS, EngineCoreOutputs([EngineCoreOutput(req.request_id, [], finish_reason="abort")], time.monotonic())))
        return True
    if kind is Req.ABORT:
        core.abort_requests(payload.request_ids)
        return True
    if kind is Req.RELEASE_KV:
        core.release_kv_transfer(payload.params)
        return True
    if kind is Req.UTILITY:
        call_id, name = payload.call_id, payload.name
        args = payload.args if isinstance(payload.args, list) else []
        if name not in UTILITIES:
            send((Event.UTILITY, UtilityResult(call_id, None, f"unknown utility {name!r}")))
            return False
        try:
            result = getattr(core, name)(*args)
        except (TypeError, ValueError) as e:  # bad arguments from the front: answer, do not die
            send((Event.UTILITY, UtilityResult(call_id, None, f"{name}: {e}")))
            return False
        send((Event.UTILITY, UtilityResult(call_id, result)))
        return name == "reset_prefix_cache"
    logger.error("pagedserve engine core: unknown message %r", kind)
    return False


def _remove_socket_dir(address: str) -> None:
    """Remove the private directory of an ``ipc://DIR/input`` address (what MPClient made)."""
    import shutil

    if address.startswith("ipc://"):
        d = os.path.dirname(address[len("ipc://") :])
        if os.path.basename(d).startswith("pagedserve-core-"):
            shutil.rmtree(d, ignore_errors=True)


def serve_core(input_address: str, output_address: str, config: dict, parent_alive: Callable[[], bool], kv_events: bool = False) -> int:
    """Connect to the front's sockets, build the core, send ``ready``, run the busy loop.
    Returns 0 after a shutdown message or the parent's death, 1 after an error (which was sent
    to the front as an ``error`` message). Used by this module's main and by the Ray replica
    actor (:mod:`pagedserve.engine.ray_client`)."""
    import msgpack
    import zmq

    from pagedserve import messages
    from pagedserve.config import EngineConfig

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)  # never drop a message (see MPClient)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(output_address)

    def send(msg: Message) -> None:
        outbox.send(messages.encode(msg), copy=False)

    def recv(timeout_s: Optional[float]) -> Optional[Message]:
        while timeout_s is None or inbox.poll(int(timeout_s * 1000)):
            data = inbox.recv(copy=False).buffer
            try:
                return messages.check(messages.decode(data), Req)
            except (ValueError, TypeError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
                logger.error("pagedserve engine core: dropped a malformed message (%d bytes): %s", len(data), e)
        return None

    started = False
    try:
        from pagedserve.engine.core import EngineCore

        core = EngineCore(EngineConfig(**config))
        started = True
        frozen = freeze_gc_heap()
        logger.debug("pagedserve engine core: %d objects frozen for the collector", frozen)
        send((Event.READY, core.info))
        try:
            run_busy_loop(core, recv, send, parent_alive=parent_alive, kv_events=kv_events)
        finally:
            core.shutdown()
        return 0
    except BaseException as e:  # start-up error or a crashed step: tell the frontend, exit non-zero
        if not started and isinstance(e, (ValueError, FileNotFoundError)):
            # A configuration error: the front prints it as one line; the traceback only at debug.
            logger.debug("pagedserve engine core refused its configuration:\n%s", traceback.format_exc())
        else:
            logger.error("pagedserve engine core failed:\n%s", traceback.format_exc())
        if not isinstance(e, KeyboardInterrupt):
            send((Event.ERROR, CoreError(type(e).__name__, str(e))))
        return 1
    finally:
        outbox.close()
        inbox.close(linger=0)
        ctx.term()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="pagedserve engine-core process (started by the server)")
    ap.add_argument("--input-address", required=True)
    ap.add_argument("--output-address", required=True)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--kv-events", action="store_true", help="publish prefix-cache events (a data-parallel replica)")
    ap.add_argument("--cpus", default=None, help="pin this process to these cores (comma-separated ids)")
    args = ap.parse_args(argv)
    if args.cpus:  # before torch starts its thread pool, whose threads inherit the mask
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    # Ctrl-C in a terminal, or a supervisor's SIGTERM, reaches the whole process group: the
    # front drains and then stops this process (a shutdown message, then a kill after a
    # timeout), so it does not die mid-step on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s")
    rc = serve_core(
        args.input_address, args.output_address, json.loads(args.config_json), parent_alive=lambda: os.getppid() == parent, kv_events=args.kv_events
    )
    if os.getppid() != parent:  # the front died without cleaning up: remove its socket directory
        _remove_socket_dir(args.input_address)
    return rc


if __name__ == "__main__":
    sys.exit(main())
