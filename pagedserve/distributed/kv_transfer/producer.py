"""NetworkConnector, producer half: a thread that serves reads of held blocks from the KV pool.

A *hold* (a finished prefill request's full prompt blocks) is registered by the worker side
from the step's metadata and ends when the consumer sends ``done``, or when its lease runs out;
either way its request id is reported in ``finished_sending`` and the scheduler frees the
blocks. The table of holds is guarded by one lock, and a read copies its blocks out under that
lock, so a hold that ends (and whose blocks may then be reused) can never be read half-way.

Test hook: when the environment variable ``PAGEDSERVE_KV_TEST_FAULT_FILE`` names a file, each
read first looks at its content and misbehaves on purpose: ``delay=S`` (sleep S seconds before
the reply), ``corrupt`` (flip one byte of the reply after its digest is taken), ``silent``
(never answer); empty or missing = behave.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
import zmq

from pagedserve.distributed.kv_transfer import wire
from pagedserve.distributed.kv_transfer.base import HoldSpec

logger = logging.getLogger("pagedserve")
POLL_MS = 50
RELEASED_KEPT = 4096  # recently ended holds, so a late read gets "released" at once, not a retry


@dataclass
class _Hold:
    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    expires: float


class KVServer:
    """Serves ``kv_cache`` (``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``, or the
    int8 pool ``[layers, 2, num_blocks, kv_heads, cell_bytes]``) to consumers on ``tcp://host:port``.

    Raises:
        ValueError: the port cannot be bound (in use, or a bad address).
    """

    def __init__(self, kv_cache: torch.Tensor, layout: dict, engine_id: str, host: str, port: int) -> None:
        self.kv = kv_cache
        self.layout = layout
        self.engine_id = engine_id
        self.block_size = layout["block_size"]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            self.sock.bind(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            self.ctx.term()
            raise ValueError(f"kv_transfer_config: cannot listen on {host}:{port} for KV transfers: {e}") from None
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._released: OrderedDict[str, str] = OrderedDict()
        self._finished: list[str] = []
        self._sent_tokens = 0
        self._failures: Counter = Counter()
        self._fault_file = os.environ.get("PAGEDSERVE_KV_TEST_FAULT_FILE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedserve-kv-server", daemon=True)
        self._thread.start()
        logger.info("pagedserve: KV transfer server (engine %s) on %s:%d", engine_id, host, port)

    # -- called by the worker side ---------------------------------------------------------
    def add_hold(self, spec: HoldSpec) -> None:
        with self._lock:
            self._holds[spec.transfer_id] = _Hold(spec.req_id, list(spec.block_ids), list(spec.block_hashes), time.monotonic() + spec.lease_s)

    def take_finished(self) -> tuple[list[str], int, Counter]:
        """Requests whose holds ended, tokens sent and failures since the last call."""
        with self._lock:
            self._expire()
            out = (self._finished, self._sent_tokens, self._failures)
            self._finished, self._sent_tokens, self._failures = [], 0, Counter()
        return out

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close(linger=0)
        self.ctx.term()

    # -- the server thread -------------------------------------------------------------------
    def _end(self, transfer_id: str, reason: str) -> None:  # with the lock held
        hold = self._holds.pop(transfer_id, None)
        if hold is not None:
            self._finished.append(hold.req_id)
            self._released[transfer_id] = reason
            while len(self._released) > RELEASED_KEPT:
                self._released.popitem(last=False)

    def _expire(self) -> None:  # with the lock held
        now = time.monotonic()
        for tid in [t for t, h in self._holds.items() if h.expires <= now]:
            logger.warning("pagedserve: KV hold %s expired before a decode instance read it; freeing its blocks", tid)
            self._failures["lease_expired"] += 1
            self._end(tid, "expired")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.sock.poll(POLL_MS):
                    frames = self.sock.recv_multipart()
                    if len(frames) >= 2:
                        self._handle(frames[0], frames[-1])
                else:
                    with self._lock:
                        self._expire()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("pagedserve: KV transfer server")
            except Exception as e:  # a bad message must not end the server thread (nor flood the log)
                logger.debug("pagedserve: KV transfer server: a message failed: %r", e)

    def _fault(self) -> str:
        if not self._fault_file:
            return ""
        try:
            with open(self._fault_file) as fh:
                return fh.read().strip()
        except OSError:
            return ""

    def _reply(self, ident: bytes, msg: list, data=None) -> None:
        self.sock.send_multipart([ident, wire.pack(msg)] + ([data] if data is not None else []), copy=data is None)

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = wire.unpack(payload)
        except ValueError as e:
            return self._reply(ident, ["error", "bad_request", str(e)])
        kind = msg[0]
        if kind == "hello" and len(msg) == 3:
            why = wire.layout_mismatch(self.layout, msg[1])
            if why is None and msg[2] != self.engine_id:
                why = f"this is engine {self.engine_id}, not {msg[2]!r}"
            return self._reply(ident, ["error", "handshake", why] if why else ["ok", self.layout])
        if kind == "done" and len(msg) == 2 and isinstance(msg[1], str):
            with self._lock:
                self._end(msg[1], "done")
            return self._reply(ident, ["ok"])
        if kind == "read" and len(msg) == 4:
            return self._read(ident, msg[1], msg[2], msg[3])
        self._reply(ident, ["error", "bad_request", f"unknown message {kind!r}"])

    def _read(self, ident: bytes, tid, indices, hashes) -> None:
        if (
            not isinstance(tid, str)
            or not isinstance(indices, list)
            or not isinstance(hashes, list)
            or len(indices) != len(hashes)
            or not 0 < len(indices) <= wire.MAX_READ_BLOCKS
            or not all(isinstance(i, int) for i in indices)
        ):
            return self._reply(ident, ["error", "bad_request", "read needs a transfer id and 1-32 block indices with their hashes"])
        fault = self._fault()
        if fault == "silent":
            return
        with self._lock:
            hold = self._holds.get(tid)
            if hold is None:
                code = "released" if tid in self._released else "unknown"
                return self._reply(ident, ["error", code, f"no KV hold {tid!r}"])
            if any(not 0 <= i < len(hold.block_ids) or hold.block_hashes[i] != h for i, h in zip(indices, hashes)):
                return self._reply(ident, ["error", "hash_mismatch", "a requested block is not the one held (different prompt or model)"])
            ids = torch.tensor([hold.block_ids[i] for i in indices], dtype=torch.long, device=self.kv.device)
            blocks = self.kv[:, :, ids].movedim(2, 0).contiguous().cpu()
            self._sent_tokens += len(indices) * self.block_size
        raw = blocks.view(torch.uint8).numpy().reshape(len(indices), -1)
        digests = [wire.digest(raw[i]) for i in range(len(indices))]
        if fault.startswith("delay="):
            time.sleep(float(fault[6:]))
        if fault == "corrupt":
            raw[0, 0] ^= 0xFF
        self._reply(ident, ["blocks", len(indices), digests], raw)
