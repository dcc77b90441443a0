"""What the engine did, step by step: a step trace and a block-map snapshot (torch-free).

The engine core asks :class:`StepTracer` for one record per step (``EngineCore.step``) and keeps
the last ``EngineConfig.trace_buffer_steps`` of them in a ring buffer (and/or writes them to
``EngineConfig.trace_file`` as JSON lines). A record is a plain ``dict`` of ints, floats, strings
and lists, so it goes through msgpack and JSON unchanged:

``step`` (int)
    index of the step, from 0, counted by the core over its whole life.
``time`` (float)
    ``time.monotonic()`` seconds when the step started (``schedule()``).
``duration_ms`` (float)
    wall time of schedule + execute + update.
``token_budget`` (int)
    ``max_num_batched_tokens``; ``num_scheduled_tokens`` (int): tokens computed this step.
``predicted_ms`` (float or None)
    the step-cost model's prediction of ``duration_ms`` when the step was planned (see
    ``EngineConfig.max_step_ms``); None when the bound is off or before its first measurement.
``target_ms`` (float or None)
    the step's time target when it was planned with prefill under the bound:
    ``max(max_step_ms, max_step_decode_multiple x`` its decodes' predicted time alone); None
    when the bound is off or nothing prefilled.
``scheduled`` (list of dicts, in scheduling order)
    ``request_id`` (str), ``phase`` ("prefill" or "decode"), ``num_tokens`` (tokens computed
    for it this step), ``num_computed_tokens`` (tokens in its KV cache before the step),
    ``num_prompt_tokens``, ``admitted`` (bool: admitted from WAITING in this step, new or
    resumed after preemption), ``prefix_hit_tokens`` (tokens served from the prefix cache
    at that admission; 0 when not admitted this step) and, for admitted ones only,
    ``queued_s`` (seconds from the request's arrival to this admission). "prefill" means the
    chunk computes prompt tokens, or recomputes tokens of a request resumed after preemption
    (every chunk of the recompute, the first one even if the prefix cache left a single token);
    "decode" is the one token of a running request whose every earlier token is in the cache;
    a decode with draft tokens (speculative decoding) also has ``num_draft_tokens``, the
    drafts among its ``num_tokens``.
``preempted`` (list of str)
    requests preempted in this step (their blocks freed, back to WAITING).
``finished`` (list of ``{"request_id", "finish_reason"}``)
    requests that finished in this step ("stop", "length", "error", "timeout"), and those
    aborted since the previous step ("abort").
``num_running``, ``num_waiting`` (int)
    queue lengths after the step.
``num_total_blocks``, ``num_used_blocks``, ``num_free_blocks``, ``num_cached_free_blocks`` (int)
    the block pool after the step: ``used + free == total``; ``cached_free`` is the part of
    ``free`` that still holds a prefix-cache hash (evicted last, reusable by a hit).

Building a record reads what the scheduler already holds (no walk over blocks); the block map
(:func:`block_map`) walks every block and is built only when asked.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Any, Iterable, Optional

from pagedserve.core.kv_cache_manager import KVCacheManager

logger = logging.getLogger("pagedserve")

# Block states of :func:`block_map` (index = the small int in its ``state`` list).
BLOCK_STATES = ("free", "used", "shared", "cached")
FREE, USED, SHARED, CACHED = range(4)


class StepTracer:
    """Builds one record per engine step; keeps the last ``buffer_steps`` and/or appends them
    to a JSON-lines file (one record per line, flushed after each).

    Args:
        buffer_steps: ring-buffer size (records); 0 keeps none.
        trace_file: path of a JSON-lines file (truncated at start), or None.
    Raises:
        OSError: when ``trace_file`` cannot be opened for writing.
    """

    def __init__(self, buffer_steps: int, trace_file: Optional[str] = None) -> None:
        self.buffer: deque[dict[str, Any]] = deque(maxlen=max(0, buffer_steps))
        self.keep = buffer_steps > 0
        self._file = open(trace_file, "w", encoding="utf-8") if trace_file else None
        self.next_step = 0
        self._aborted: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.keep or self._file is not None

    def note_aborted(self, request_ids: Iterable[str]) -> None:
        """Requests finished outside a step (abort): reported in the next step's record."""
        self._aborted.extend(request_ids)

    @staticmethod
    def scheduled_entries(scheduler: Any, scheduler_output: Any) -> list[dict[str, Any]]:
        """This step's requests, read right after ``schedule()`` (which has already advanced
        each request's ``num_computed_tokens`` by its chunk) and before the model runs."""
        new_ids = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        now = time.monotonic()
        reqs = scheduler.scheduled_requests
        out = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = reqs[rid]
            before = req.num_computed_tokens - n
            num_prompt = req.num_prompt_tokens
            admitted = rid in new_ids
            out.append(
                {
                    "request_id": rid,
                    # Admitted = new (its hit stops short of the prompt's end) or resumed after a
                    # preemption (a recompute, even when the prefix cache leaves one token to run).
                    "phase": "prefill" if (admitted or before < num_prompt or before < req.num_tokens - 1) else "decode",
                    "num_tokens": n,
                    "num_computed_tokens": before,
                    "num_prompt_tokens": num_prompt,
                    "admitted": admitted,
                    "prefix_hit_tokens": before if admitted else 0,
                }
            )
            if admitted:
                out[-1]["queued_s"] = max(0.0, now - req.arrival_time)
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                out[-1]["num_draft_tokens"] = len(drafts)
        return out

    def record(self, start: float, scheduled: list[dict[str, Any]], scheduler: Any, scheduler_output: Any, core_outputs: Any) -> dict[str, Any]:
        """Finish this step's record (after ``update_from_output``), store and/or write it."""
        now = time.monotonic()
        pool = scheduler.kv_cache_manager.block_pool
        finished = [{"request_id": rid, "finish_reason": "abort"} for rid in self._aborted]
        self._aborted = []
        for o in core_outputs.outputs:
            if o.finish_reason is not None:
                finished.append({"request_id": o.request_id, "finish_reason": o.finish_reason})
        free = pool.num_free_blocks
        step_budget = getattr(scheduler, "step_budget", None)
        rec = {
            "step": self.next_step,
            "time": start,
            "duration_ms": 1000.0 * (now - start),
            "token_budget": scheduler.config.max_num_batched_tokens,
            "num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
            "predicted_ms": getattr(step_budget, "last_predicted_ms", None),
            "target_ms": getattr(step_budget, "last_target_ms", None),
            "scheduled": scheduled,
            "preempted": list(scheduler_output.preempted_req_ids),
            "finished": finished,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_total_blocks": pool.num_blocks,
            "num_used_blocks": pool.num_blocks - free,
            "num_free_blocks": free,
            "num_cached_free_blocks": pool.num_cached_free_blocks,
        }
        self.next_step += 1
        if self.keep:
            self.buffer.append(rec)
        if self._file is not None:
            try:
                self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
                self._file.flush()
            except OSError as e:  # a full disk must not take the engine down: stop writing, keep serving
                logger.error("pagedserve: writing the trace file failed (%s); no more trace lines are written", e)
                self._close_file()
        return rec

    def get(self, since_step: Optional[int] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """Buffered records with ``step >= since_step`` (all when None), oldest first; at most
        ``limit`` of them (the oldest ones: poll again from the last step + 1 for the rest)."""
        buf = self.buffer
        if not buf:
            return []
        if since_step is None or since_step <= buf[0]["step"]:
            start = 0
        else:
            start = since_step - buf[0]["step"]  # steps in the buffer are consecutive
            if start >= len(buf):
                return []
        stop = len(buf) if limit is None else min(len(buf), start + max(0, limit))
        return [buf[i] for i in range(start, stop)]

    def close(self) -> None:
        self._close_file()

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def block_map(kv_cache_manager: KVCacheManager, running_ids: Optional[list[str]] = None) -> dict[str, Any]:
    """A snapshot of every block of the pool (O(num_blocks); build it only when asked).

    Returns a dict:
        ``block_size`` (tokens per block), ``num_blocks``,
        ``state``: one small int per block id, an index into ``state_names``
        (``["free", "used", "shared", "cached"]``): 0 free (no live request, no hash),
        1 used by one request, 2 shared prefix (``ref_cnt > 1``: several requests hold it),
        3 cached-evictable (free, still holds a prefix-cache hash),
        ``owner``: one int per block id, an index into ``request_ids`` of the request that
        holds it (for "shared", the first in ``request_ids`` order), -1 for free and cached,
        ``ref_cnt``: one int per block id,
        ``request_ids``: the requests holding blocks, running order first when
        ``running_ids`` is given.
    """
    pool = kv_cache_manager.block_pool
    tables = kv_cache_manager.req_to_blocks
    order = [r for r in (running_ids or []) if r in tables]
    seen = set(order)
    order += [r for r in tables if r not in seen]
    owner = [-1] * pool.num_blocks
    for i, rid in enumerate(order):
        for b in kv_cache_manager.held_blocks(rid):  # not a sliding window's released entries
            if owner[b.block_id] < 0:
                owner[b.block_id] = i
    state = []
    ref_cnt = []
    for b in pool.blocks:
        rc = b.ref_cnt
        ref_cnt.append(rc)
        state.append(SHARED if rc > 1 else USED if rc == 1 else CACHED if b.block_hash is not None else FREE)
    return {
        "block_size": kv_cache_manager.block_size,
        "num_blocks": pool.num_blocks,
        "state_names": list(BLOCK_STATES),
        "state": state,
        "owner": owner,
        "ref_cnt": ref_cnt,
        "request_ids": order,
    }
