"""Short garbage-collector pauses in a serving process.

After start-up a process holds a few hundred thousand long-lived objects (modules, torch
modules, the tokenizer). Python's full collection walks every one of them: during a W1 run over
HTTP it paused the engine core for 217 ms in the middle of a step and the server's front for
194 ms (docs/perf-history.md, "the collector's pauses"). ``gc.freeze()`` moves what is alive to a
permanent generation that collections skip, so a later full collection walks only what was
made since. vLLM does the same once a server has started (``freeze_gc_heap`` in
``vllm/utils/gc_utils.py``).

Called by the engine-core process and the server's front once they are ready; not by ``LLM``,
whose process is the caller's (and whose offline runs measured no full collection).
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect now (garbage must not be frozen: it would never be freed), then freeze every
    object still alive. Returns how many objects are frozen in this process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
