"""The CUDA step of a :class:`~pagedserve.worker.model_runner.ModelRunner` without per-step host
stalls (vLLM v1's ``GPUModelRunner`` shape):

- the flat batch and the flat attention inputs are gathered with NumPy straight into pinned
  host buffers and copied once each with ``non_blocking=True`` into device buffers at fixed
  addresses (:class:`~pagedserve.worker.step_buffers.StepBuffers`);
- the logits rows are picked on the device (``query_start_loc[1:] - 1``; a decode-only step
  needs no index at all); only a step where some request does not sample stages its indices;
- the sampling state goes through a pinned staging arena (one copy);
- seeded requests draw from their own CUDA generators (``CachedRequestState.create``);
- the sampled tokens and, when asked, their logprobs, ids and ranks come back in one
  device->host copy;
- decode-only steps can replay a CUDA graph at a padded batch size
  (:class:`~pagedserve.worker.cuda_graphs.DecodeGraphs`, off unless ``enforce_eager=False``).

Used only on CUDA with the Triton attention backend, without LoRA, pooling or tensor
parallelism, for steps without speculative drafts; every other step (and every CPU step)
takes ``ModelRunner.execute_model``'s own path. Feature paths keep their syncs (prompt
logprobs, grammar masks, logit bias, min_tokens and banned-token tensors, the exact pass of a
logprobs tie at the top-k cut is branch-free on CUDA: ``pagedserve.model.logprobs``).

On CPU (tests) the same code runs with unpinned buffers and plain copies, and the graphs run
their padded forward eagerly: what is untested until a GPU run is the asynchrony itself
(pinning, event waits, graph capture and replay).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.model.attn_metadata import AttentionMetadata
from pagedserve.model.sampler import SamplerOutput, apply_grammar_bitmask
from pagedserve.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pagedserve.worker.input_batch import flat_batch
from pagedserve.worker.step_buffers import HostSync, StagingArena, StepBuffers

if TYPE_CHECKING:
    from pagedserve.worker.model_runner import ModelRunner

ARENA_BYTES = 4 << 20  # per-step sampling tensors; larger ones (long penalty histories) are copied alone


def fetch_sampled(res: SamplerOutput) -> tuple[np.ndarray, Optional[tuple[list, list, list]]]:
    """The sampled tokens ``[B]`` int64 and, when the sampler gathered logprobs, ``(logprobs
    [B][k + 1], token ids [B][k + 1], ranks [B])`` as lists, in ONE device->host copy: every
    tensor packed into one float64 vector (token ids < 2**53 and float32 logprobs are exact
    in float64)."""
    t = res.sampled_token_ids
    if res.logprobs is None:
        return t.to("cpu").numpy().astype(np.int64, copy=False), None
    assert res.logprob_token_ids is not None and res.sampled_ranks is not None
    B, K = res.logprobs.shape
    parts = [t.double(), res.sampled_ranks.double(), res.logprob_token_ids.double().reshape(-1), res.logprobs.double().reshape(-1)]
    host = torch.cat(parts).to("cpu").numpy()
    tokens = host[:B].astype(np.int64)
    ranks = host[B : 2 * B].astype(np.int64).tolist()
    ids = host[2 * B : 2 * B + B * K].astype(np.int64).reshape(B, K).tolist()
    lps = host[2 * B + B * K :].reshape(B, K).tolist()
    return tokens, (lps, ids, ranks)


class CudaStepRunner:
    """Runs ``runner``'s steps on CUDA (see the module doc).

    Args:
        runner: the model runner whose state (input batch, requests, model, KV cache) it uses.
        max_num_tokens: the step token budget (buffers hold ``max(max_num_tokens,
            max_num_reqs)`` tokens; a larger step falls back to the runner's own path).
        scratch_block: with CUDA graphs, the KV block padded rows write to (one past the
            pool); None = no graphs.
        max_model_len: the longest sequence (fixes the graphs' split-KV count).
        capture: capture the graphs (CUDA); False runs padded decode steps eagerly (CPU tests).
    """

    def __init__(self, runner: ModelRunner, max_num_tokens: int, scratch_block: Optional[int], max_model_len: int, capture: bool = True) -> None:
        self.runner = runner
        dev = runner.device
        batch = runner.input_batch
        R = len(batch.req_ids)
        self.buffers = StepBuffers(max(max_num_tokens, R), R, batch.block_table.shape[1], dev)
        self.arena = StagingArena(ARENA_BYTES, dev)
        self.sync = HostSync(dev)
        self.scratch_block = scratch_block
        self.graphs: Optional[DecodeGraphs] = None
        if scratch_block is not None:
            self.graphs = DecodeGraphs(
                runner.model, runner.kv_caches, self.buffers, runner.block_size, scratch_block, max_model_len, graph_batch_sizes(R), capture
            )
            self.graphs.capture()

    def can_run(self, so: SchedulerOutput) -> bool:
        """Whether this step takes the CUDA path (no drafts, within the buffers)."""
        return not so.scheduled_spec_decode_tokens and so.total_num_scheduled_tokens <= self.buffers.max_num_tokens

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step (``so`` already applied to the runner's state, not empty, no drafts)."""
        r = self.runner
        batch = r.input_batch
        self.sync.wait()  # the last step's copies out of the pinned buffers have run
        self.arena.reset()
        B = r.block_size
        fb = flat_batch(batch, so.num_scheduled_tokens, B)
        order, rows, nsched, context, ends = fb.order, fb.rows, fb.nsched, fb.context, fb.ends
        positions, input_ids, slots = fb.positions, fb.input_ids, fb.slots
        seq_lens = context + nsched
        decode_only = fb.num_decodes == len(order)
        pad = self.graphs.padded_size(len(order)) if self.graphs is not None and decode_only else None
        staged = self.buffers.stage(input_ids, positions, slots, nsched, seq_lens, batch.block_table, rows, B, pad, self.scratch_block or 0)
        if pad is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(staged)
        else:
            meta = AttentionMetadata(staged.slot_mapping, [], B, flat=staged.flat)
            hidden = r.model(staged.input_ids, staged.positions, r.kv_caches, meta)

        out = ModelRunnerOutput()
        r._prompt_logprobs(order, rows, nsched, context, ends, hidden, out)
        samples = seq_lens == batch.num_tokens[rows]
        if not samples.any():
            self.sync.record()
            return out
        sample_rows = rows[samples]
        sample_ids = [order[i] for i in np.flatnonzero(samples).tolist()]
        idx = None if samples.all() else self.arena.put(ends[samples] - 1)
        meta_s = batch.sampling_metadata(sample_rows, to_device=self.arena.put)
        self.arena.flush()  # enqueued before any kernel that reads the arena
        self.sync.record()
        if idx is not None:
            picked = hidden[idx]
        elif decode_only:
            picked = hidden  # one token per request, each its request's last
        else:
            picked = hidden[staged.flat.query_start_loc[1 : len(order) + 1].long() - 1]
        logits = r.model.compute_logits(picked)
        assert logits is not None  # no tensor parallelism on this path
        grammar = r._grammar_rows(so, {rid: i for i, rid in enumerate(sample_ids)})
        if grammar is not None:
            apply_grammar_bitmask(logits, *grammar)
        tokens, lp = fetch_sampled(r.sampler(logits, meta_s))
        batch.append_sampled(sample_rows, tokens)
        out.sampled.update(zip(sample_ids, tokens.tolist()))
        if lp is not None:
            lps, ids, ranks = lp
            for i, (rid, row) in enumerate(zip(sample_ids, sample_rows.tolist())):
                k = int(batch.num_logprobs[row])
                if k >= 0:
                    out.logprobs[rid] = [(ids[i][: k + 1], lps[i][: k + 1], ranks[i])]
        return out
