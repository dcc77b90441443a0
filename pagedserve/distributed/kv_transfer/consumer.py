"""NetworkConnector, consumer half: loads that pull held blocks from a producer into this
instance's KV pool, a few at a time on a small thread pool (one socket per load, so a reply
that arrives after a timeout can never be taken for another load's).

A load: ``hello`` (the producer checks model, dtype, block size, KV layout and its engine id),
then ``read``s of up to ``wire.MAX_READ_BLOCKS`` blocks, each block checked against its digest
before it is written into its (already allocated, not yet scheduled) local block, then ``done``
so the producer frees its hold at once. Every wait is bounded by ``timeout_s``; a transfer the
producer has not registered yet ("unknown") is retried within that bound. A failed load is
reported with its reason and still sends ``done`` (best effort), so no hold outlives its use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from pagedserve.distributed.kv_transfer import wire
from pagedserve.distributed.kv_transfer.base import LoadSpec, ReleaseSpec

logger = logging.getLogger("pagedserve")
MAX_PARALLEL_LOADS = 8
RETRY_S = 0.005
UNKNOWN_RETRY_S = 3.0  # a hold is registered with the producer's next step: wait at most this for it
PEER_DOWN_S = 5.0  # default: after a peer timed out, loads from it fail at once for this long
RELEASE_TIMEOUT_S = 1.0


class _Fail(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class KVLoader:
    """Pulls blocks into ``kv_cache`` (``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``,
    or ``[layers, 2, num_blocks, kv_heads, cell_bytes]`` int8: a block is whatever follows its index)."""

    def __init__(self, kv_cache: torch.Tensor, layout: dict, timeout_s: float, peer_down_s: float = PEER_DOWN_S) -> None:
        self.kv = kv_cache
        self.layout = layout
        self.block_size = layout["block_size"]
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context()
        self.pool = ThreadPoolExecutor(MAX_PARALLEL_LOADS, thread_name_prefix="pagedserve-kv-load")
        self.release_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-kv-release")  # never delays a load
        # (host, port, engine id) -> until when loads from it fail at once. The engine id is part
        # of the key: a prefill instance restarted on the same address (a new id) is used at once.
        self._down_until: dict[tuple[str, int, str], float] = {}
        self.peer_down_s = peer_down_s
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._cancelled: set[str] = set()
        self._done: list[str] = []
        self._failed: dict[str, str] = {}
        self._received_tokens = 0
        self._seconds: list[float] = []
        self._failures: Counter = Counter()
        self._closed = False

    # -- called by the worker side -----------------------------------------------------------
    def submit(self, spec: LoadSpec) -> None:
        with self._lock:
            self._active.add(spec.req_id)
        self.pool.submit(self._load, spec)

    def release(self, spec: ReleaseSpec) -> None:
        self.release_pool.submit(self._release, spec)

    def cancel(self, req_ids: list[str]) -> None:
        with self._lock:
            self._cancelled.update(r for r in req_ids if r in self._active)

    def take_finished(self) -> tuple[list[str], dict[str, str], int, list[float], Counter]:
        with self._lock:
            out = (self._done, self._failed, self._received_tokens, self._seconds, self._failures)
            self._done, self._failed, self._received_tokens, self._seconds, self._failures = [], {}, 0, [], Counter()
        return out

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            self._cancelled.update(self._active)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.release_pool.shutdown(wait=True, cancel_futures=True)
        self.ctx.term()

    # -- the loads ---------------------------------------------------------------------------
    def _peer_down(self, spec: LoadSpec | ReleaseSpec) -> bool:
        with self._lock:
            return self._down_until.get((spec.host, spec.port, spec.engine_id), 0.0) > time.monotonic()

    def _socket(self, host: str, port: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        return sock

    def _ask(self, sock: zmq.Socket, msg: list, deadline: float) -> list[bytes]:
        sock.send(wire.pack(msg))
        left = max(1, int((deadline - time.monotonic()) * 1000))
        if not sock.poll(left):
            raise _Fail("timeout", f"no answer to {msg[0]} in {self.timeout_ms} ms")
        return sock.recv_multipart()

    def _load(self, spec: LoadSpec) -> None:
        t0 = time.monotonic()
        sock = self._socket(spec.host, spec.port)
        try:
            if self._peer_down(spec):
                raise _Fail("peer_down", f"{spec.host}:{spec.port} timed out less than {self.peer_down_s:g} s ago")
            self._pull(sock, spec)
            dt = time.monotonic() - t0
            with self._lock:
                self._done.append(spec.req_id)
                self._received_tokens += spec.num_tokens
                self._seconds.append(dt)
        except Exception as e:  # every failure is the request's, never the engine's
            reason = e.reason if isinstance(e, _Fail) else "error"
            if reason == "timeout":
                with self._lock:
                    now = time.monotonic()
                    self._down_until = {k: t for k, t in self._down_until.items() if t > now}  # restarted peers' old ids
                    self._down_until[(spec.host, spec.port, spec.engine_id)] = now + self.peer_down_s
            if reason != "aborted":
                logger.warning("pagedserve: KV load for %s from %s:%d failed: %s", spec.req_id, spec.host, spec.port, e)
            with self._lock:
                self._failed[spec.req_id] = reason
                self._failures[reason] += 1
        finally:
            try:  # the producer may free its hold now, whatever happened
                if not self._closed and not self._peer_down(spec):
                    self._ask(sock, ["done", spec.transfer_id], time.monotonic() + min(RELEASE_TIMEOUT_S, self.timeout_ms / 1000))
            except Exception:
                pass
            sock.close(linger=0)
            with self._lock:
                self._active.discard(spec.req_id)
                self._cancelled.discard(spec.req_id)

    def _pull(self, sock: zmq.Socket, spec: LoadSpec) -> None:
        deadline = time.monotonic() + self.timeout_ms / 1000
        head = wire.unpack(self._ask(sock, ["hello", self.layout, spec.engine_id], deadline)[0])
        if head[0] != "ok":
            raise _Fail("handshake", str(head[2] if len(head) > 2 else head))
        nbytes = self.kv[:, :, 0].numel() * self.kv.element_size()  # one block of every layer, K and V
        shape = (*self.kv.shape[:2], *self.kv.shape[3:])
        step = wire.MAX_READ_BLOCKS
        for lo in range(0, len(spec.block_indices), step):
            idx, hashes = spec.block_indices[lo : lo + step], spec.block_hashes[lo : lo + step]
            started = time.monotonic()
            deadline = started + self.timeout_ms / 1000
            while True:
                with self._lock:
                    if spec.req_id in self._cancelled or self._closed:
                        raise _Fail("aborted")
                frames = self._ask(sock, ["read", spec.transfer_id, idx, hashes], deadline)
                head = wire.unpack(frames[0])
                if head[0] == "error" and len(head) > 1 and head[1] == "unknown" and time.monotonic() < min(deadline, started + UNKNOWN_RETRY_S):
                    time.sleep(RETRY_S)  # the producer registers its hold with its next step
                    continue
                break
            if head[0] != "blocks":
                raise _Fail("peer_error" if head[1:2] != ["hash_mismatch"] else "hash_mismatch", str(head[1:]))
            if len(frames) != 2 or head[1] != len(idx) or len(frames[1]) != nbytes * len(idx) or len(head[2]) != len(idx):
                raise _Fail("peer_error", "a reply of the wrong size")
            raw = memoryview(frames[1])
            for i, d in enumerate(head[2]):
                if wire.digest(raw[i * nbytes : (i + 1) * nbytes]) != d:
                    raise _Fail("digest", f"block {idx[i]} arrived with a wrong digest")
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.kv.dtype).view(len(idx), *shape)
            local = torch.tensor(spec.local_block_ids[lo : lo + step], dtype=torch.long, device=self.kv.device)
            self.kv[:, :, local] = data.movedim(0, 2).to(self.kv.device)

    def _release(self, spec: ReleaseSpec) -> None:
        if self._closed or self._peer_down(spec):
            return  # its lease frees it
        sock = self._socket(spec.host, spec.port)
        try:
            self._ask(sock, ["done", spec.transfer_id], time.monotonic() + RELEASE_TIMEOUT_S)
        except Exception as e:
            logger.info("pagedserve: could not release KV hold %s at %s:%d (its lease frees it): %s", spec.transfer_id, spec.host, spec.port, e)
        finally:
            sock.close(linger=0)
