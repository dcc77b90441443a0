"""The scheduler's part in prefill/decode disaggregation (:class:`RemoteKVWaiter`).

A decode instance's request whose prompt KV can come from a prefill instance is admitted in
two stages: first its blocks are allocated (after its local prefix-cache hit) and it waits in
``WAITING_FOR_REMOTE_KVS``, holding them without running while the connector's worker side
fills them; when the load is reported, it goes back to the front of the waiting queue with
``num_computed_tokens`` covering the loaded blocks and computes only the rest. A request
aborted mid-load keeps its blocks until the worker reports the load over (its cancelled
transfer may still be writing them). On a prefill instance, a finished ``do_remote_decode``
request's blocks are kept (``held_for_transfer``) until the worker side reports the hold over.
vLLM v1's scheduler does the same with ``WAITING_FOR_REMOTE_KVS`` and ``finished_sending``.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.outputs import KVConnectorOutput, SchedulerStats
from pagedserve.core.request import Request, RequestStatus

logger = logging.getLogger("pagedserve")

KV_LOAD_POLL_S = 0.002  # how often an otherwise idle core checks for finished loads
KV_HOLD_POLL_S = 0.05  # ... and for holds the decode side released


class RemoteKVWaiter:
    """Requests of a decode instance that wait for their prompt KV from a prefill instance, and
    finished requests of a prefill instance whose blocks are held for a decode instance.

    The scheduler keeps the queues: it pops a request that starts waiting here, puts the ones
    whose load ended back at the front of its waiting queue, and does the bookkeeping of the
    ones that finish (this object frees or holds their blocks).

    Args:
        connector: the scheduler side of the KV connector
            (``pagedserve.distributed.kv_transfer.scheduler_side``).
        kv_cache_manager: the block tables and prefix cache.
        block_size: tokens per block.
        stats: the scheduler's counters; the prefix-cache counters of requests admitted to wait,
            and ``kv_transfer_*``, are counted here.

    Attributes:
        waiting_for_remote: request id -> request in ``WAITING_FOR_REMOTE_KVS`` (an aborted one
            stays until its load reports, as its blocks may still be written).
        held_for_transfer: request id -> finished request whose blocks a decode instance reads.
    """

    def __init__(self, connector, kv_cache_manager: KVCacheManager, block_size: int, stats: SchedulerStats) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.stats = stats
        self.waiting_for_remote: dict[str, Request] = {}
        self.held_for_transfer: dict[str, Request] = {}

    def in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` is still taken here (waiting, or its blocks held)."""
        return request_id in self.waiting_for_remote or request_id in self.held_for_transfer

    def try_admit(self, req: Request, hit_blocks: list, num_hit: int) -> Optional[bool]:
        """For the request at the head of the waiting queue, after its local prefix-cache hit:
        None = no remote KV (admit it as usual); True = it now waits for remote KV (the caller
        pops it from the queue); False = no blocks for it now (stop admitting this step)."""
        from pagedserve.core.kv_connector import WAIT_FOR_OTHER_LOAD

        num_external = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_external == 0:
            return None
        kv = self.kv_cache_manager
        if num_external != WAIT_FOR_OTHER_LOAD:
            if kv.allocate_slots(req, num_external, hit_blocks, num_hit, register_new=False) is None:
                self.connector.request_dropped(req.request_id)
                return False
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_hit, num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req
        return True

    def abort(self, req: Request) -> bool:
        """A waiting request finishes (abort, timeout; its status is set). True when its load
        may still write its blocks: it keeps them until the load reports (the worker side
        cancels the load once the request id reaches it as finished); False when it waited on a
        sibling's load and holds nothing."""
        rid = req.request_id
        if rid in self.kv_cache_manager.req_to_blocks:
            return True
        del self.waiting_for_remote[rid]
        self.connector.request_dropped(rid)
        return False

    def release_blocks(self, req: Request) -> None:
        """A finished request's blocks: kept for a remote reader, or freed now."""
        if req.kv_transfer_params is not None:
            delay, req.kv_transfer_params_out = self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req.request_id))
            if delay:
                self.held_for_transfer[req.request_id] = req
                self.kv_cache_manager.free_tail(req, len(req.kv_transfer_params_out["remote_block_ids"]))
                return
        self.kv_cache_manager.free(req)

    def update(self, kvo: KVConnectorOutput) -> tuple[list[Request], list[Request]]:
        """Apply what the worker side finished.

        Returns:
            the requests to put back at the front of the waiting queue, in order (loaded, or
            to recompute after a failed load under ``kv_load_failure_policy`` "recompute"), and
            the requests that failed for good (status ``FINISHED_ERROR``, blocks freed).
        """
        kv = self.kv_cache_manager
        for rid in kvo.finished_sending:
            req = self.held_for_transfer.pop(rid, None)
            if req is not None:
                kv.free(req)
        resumed: list[Request] = []
        failed_for_good: list[Request] = []
        failed = dict(kvo.failed_recving)
        for rid in list(kvo.finished_recving) + list(failed):
            req = self.waiting_for_remote.pop(rid, None)
            if req is None:  # a repeated report
                continue
            waiters = [self.waiting_for_remote.pop(w) for w in self.connector.load_finished(rid) if w in self.waiting_for_remote]
            if req.is_finished():  # aborted while loading: the blocks are free to go now
                kv.free(req)
                self.connector.request_dropped(rid)
            elif rid not in failed:
                req.num_computed_tokens = len(kv.req_to_blocks[rid]) * self.block_size
                kv.cache_loaded_blocks(req, req.num_computed_tokens)  # siblings and later requests hit them
                req.status = RequestStatus.WAITING
                resumed.append(req)
            elif self.connector.config.kv_load_failure_policy == "recompute":
                logger.warning("pagedserve: %s: KV transfer failed (%s); computing its prompt here", rid, failed[rid])
                kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                resumed.append(req)
            else:
                req.status = RequestStatus.FINISHED_ERROR
                req.error = f"KV transfer from the prefill instance failed ({failed[rid]})"
                self.release_blocks(req)
                failed_for_good.append(req)
            for w in waiters:
                w.status = RequestStatus.WAITING
                resumed.append(w)
        s = self.stats
        s.kv_transfer_sent_tokens += kvo.sent_tokens
        s.kv_transfer_received_tokens += kvo.received_tokens
        for reason, n in kvo.failures.items():
            s.kv_transfer_failures[reason] = s.kv_transfer_failures.get(reason, 0) + n
        return resumed, failed_for_good

    def release_loaded(self, requests: Iterable[Request]) -> bool:
        """Nothing runs and the head of the waiting queue cannot get blocks: these waiting
        requests (the ones behind it) that hold loaded KV give their blocks back (they stay in
        the prefix cache, so those requests usually hit them again). True when any did."""
        kv = self.kv_cache_manager
        freed = False
        for req in requests:
            if req.request_id in kv.req_to_blocks:
                kv.free(req)
                req.num_computed_tokens = 0
                freed = True
        return freed

    def poll_interval(self) -> Optional[float]:
        """Seconds between checks for KV transfers that finished while nothing else runs, or
        None when none is outstanding."""
        if self.waiting_for_remote or self.connector.has_pending_meta():
            return KV_LOAD_POLL_S
        return KV_HOLD_POLL_S if self.held_for_transfer else None
