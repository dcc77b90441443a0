"""Helpers for tests that drive two engine cores as a prefill/decode (KV transfer) pair by hand:
requests with distinct 70-token prompts, stepping cores until a condition, the idle check."""
from __future__ import annotations

import time

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams
from server_utils import free_port


def prompt(rid: str) -> list[int]:
    """70 tokens (4 full blocks + 6), different per request id (so no test hits another's cache)."""
    base = 3 + 80 * int(rid[1:])
    return list(range(base, base + 70))


def make_core(model, role, **kv):
    from pagedserve.engine.core import EngineCore

    return EngineCore(EngineConfig(model=model, dtype="float32", num_threads=1, num_kv_blocks=32,
                                   kv_transfer_config={"kv_role": role, "kv_port": free_port(), **kv}))


def add(core, rid, max_tokens, params):
    core.add_request(EngineCoreRequest(rid, prompt(rid), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), [2],
                                       time.monotonic(), None, None, params))


def run(cores, until, timeout=20.0):
    """Step every core until ``until()``; returns the outputs of each core."""
    outs = {id(c): [] for c in cores}
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline
        for c in cores:
            outs[id(c)] += c.step().outputs
        time.sleep(0.002)
    return outs


def idle(core):
    s = core.scheduler
    remote = s.remote_kv  # None without a KV connector
    return (not s.requests and (remote is None or not (remote.waiting_for_remote or remote.held_for_transfer)) and not s.kv_cache_manager.req_to_blocks
            and s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_total_blocks)
