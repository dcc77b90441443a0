"""ModelRunner: turns a :class:`SchedulerOutput` into one forward pass and sampled tokens.

It owns the KV cache tensors, the persistent :class:`InputBatch` and the sampler; it never
decides who runs. Each step it first applies the message's diffs to its own state (vLLM v1's
``gpu_model_runner._update_states``): drop finished requests, drop the rows of preempted ones
(keeping their seeded generators), add new ones, append new block ids and tokens. Then it
gathers the flat batch (``input_ids``, ``positions``, ``slot_mapping``) and the attention groups
(decodes, then prefill chunks) from the rows with NumPy, runs the model, computes logits only
for the last scheduled token of each request whose chunk reaches the end of its known tokens
(and for every prompt position of a request that asked for prompt logprobs), samples, and
appends the sampled tokens to the rows. A decode with draft tokens (speculative decoding) gets
logits for its last token and each draft; the drafts its sampling keeps and the token after
them are appended (``_verify_drafts``).

Under tensor parallelism every rank runs this same code on the same message: the model's
collectives pair the ranks' forwards, rank 0 gets the full logits, samples and broadcasts the
token ids, and the other ranks append those (their output is empty).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.logprobs import gather_logprobs
from pagedserve.model.rejection_sampler import rejection_sample
from pagedserve.model.sampler import Sampler, apply_grammar_bitmask
from pagedserve.ops import kv_int8
from pagedserve.worker.input_batch import CachedRequestState, InputBatch, flat_batch

if TYPE_CHECKING:
    from pagedserve.worker.cuda_step import CudaStepRunner
    from pagedserve.worker.lora_manager import LoRAManager

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V for one block across all layers (int8: values and their scales)."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if kv_cache_dtype == kv_int8.KV_INT8:
        return 2 * config.num_hidden_layers * num_kv_heads * kv_int8.cell_bytes(block_size, head_dim)
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim * elem


class ModelRunner:
    """Runs the model over a paged KV cache.

    Args:
        model: a loaded LlamaForCausalLM (weights on ``device``, in ``dtype``).
        num_blocks: KV cache pool size (blocks); the cache is
            ``num_layers x [2, num_blocks, num_kv_heads, block_size, head_dim]`` in ``dtype``, or
            with ``kv_cache_dtype="int8"`` ``num_layers x [2, num_blocks, num_kv_heads,
            cell_bytes]`` int8 (:mod:`pagedserve.ops.kv_int8`).
        max_num_reqs, max_model_len: size of the input batch (rows, tokens per row).
        lora_manager: with LoRA on, the adapters; each step's rows run with their request's.
        pooling_type: None (generate: sample tokens) or the pooling runner's "LAST", "MEAN" or
            "CLS": a request whose chunk reaches the end of its prompt gets its pooled final-norm
            hidden state (``ModelRunnerOutput.pooled``) instead of a sampled token.
        max_num_tokens, enforce_eager: CUDA only: the step token budget (the step buffers'
            size) and whether to skip CUDA graphs (with graphs the pool gets one scratch block
            past ``num_blocks`` for padded rows). On CUDA with the Triton backend and without
            LoRA, pooling or tensor parallelism, steps without drafts run in
            :class:`~pagedserve.worker.cuda_step.CudaStepRunner` (no host stalls); everything
            else, and every CPU step, runs here.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_model_len: int,
        kv_cache_dtype: str = "auto",
        pooling_type: Optional[str] = None,
        lora_manager: Optional[LoRAManager] = None,
        max_num_tokens: Optional[int] = None,
        enforce_eager: bool = True,
    ) -> None:
        cfg = model.config
        self.pooling_type = pooling_type
        self.lora_manager = lora_manager
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        attn = model.layers[0].self_attn
        if kv_cache_dtype == kv_int8.KV_INT8:
            shape = (cfg.num_hidden_layers, *kv_int8.cache_shape(num_blocks, attn.num_kv_heads, block_size, attn.head_dim))
            kv_dtype = torch.int8
        else:
            shape = (cfg.num_hidden_layers, 2, num_blocks, attn.num_kv_heads, block_size, attn.head_dim)
            kv_dtype = dtype
        # Zero-filled: stale block-table entries read slots that are masked out, and masking
        # needs them finite. (2 MiB pages for the pool: no faster on W1, see docs/perf-history.md, "Issue 15, round three".)
        cuda_step = (
            device.type == "cuda"
            and pooling_type is None
            and lora_manager is None
            and model.tp is None
            and model.backend.name == "triton"
            and not any(layer.self_attn.sliding_window or getattr(layer.self_attn, "softcap", None) for layer in model.layers)
        )  # the staged flat metadata has no groups: windows and Gemma 2's softcap need the PyTorch path
        graphs = cuda_step and not enforce_eager
        if graphs:  # one scratch block past the pool, for the padded rows of graph steps
            full = torch.zeros((*shape[:2], num_blocks + 1, *shape[3:]), dtype=kv_dtype, device=device)
            self.kv_cache = full[:, :, :num_blocks]
            self.kv_caches = list(full.unbind(0))
        else:
            self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
            self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler(model.backend.argmax)
        self.requests: dict[str, CachedRequestState] = {}
        self.prompt_logprob_reqs: set[str] = set()  # requests that asked for prompt_logprobs
        self.input_batch = InputBatch(max_num_reqs, max_model_len, -(-max_model_len // block_size), cfg.vocab_size, device)
        self.generator_device = device if device.type == "cuda" else None  # seeded requests' generators
        self.cuda_step: Optional[CudaStepRunner] = None
        if cuda_step:
            from pagedserve.worker.cuda_step import CudaStepRunner

            self.cuda_step = CudaStepRunner(self, max_num_tokens or max_model_len, num_blocks if graphs else None, max_model_len)

    # -- state ----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.prompt_logprob_reqs.discard(rid)
            batch.remove_request(rid)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)  # a resumed request keeps its generator
            if state is None:
                state = CachedRequestState.create(new.req_id, new.sampling_params, new.eos_token_ids, self.generator_device)
                state.lora_int_id = new.lora_request.lora_int_id if new.lora_request is not None else 0
                self.requests[new.req_id] = state
                if new.sampling_params.prompt_logprobs is not None:
                    self.prompt_logprob_reqs.add(new.req_id)
            batch.remove_request(new.req_id)
            batch.add_request(state, new.prompt_token_ids, new.output_token_ids, new.block_ids, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        row_of = batch.row_of
        for rid, block_ids, num_computed, token_ids in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.new_token_ids):
            row = row_of[rid]
            batch.append_block_ids(row, block_ids)
            batch.append_token_ids(row, token_ids)
            batch.num_computed_tokens[row] = num_computed

    # -- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Apply ``so`` to the worker's state and run its tokens.

        Raises:
            KeyError: a cached request the worker does not hold (a broken message).
        """
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput()
        if self.cuda_step is not None and self.cuda_step.can_run(so):
            return self.cuda_step.execute(so)
        batch = self.input_batch
        spec = so.scheduled_spec_decode_tokens
        for rid, drafts in spec.items():  # drafts go after the known tokens; kept ones stay there
            row = batch.row_of[rid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(drafts)] = drafts
        B = self.block_size
        fb = flat_batch(batch, so.num_scheduled_tokens, B)
        order, rows, nsched, context, ends = fb.order, fb.rows, fb.nsched, fb.context, fb.ends
        positions, input_ids, slots = fb.positions, fb.input_ids, fb.slots

        groups = []
        nd = fb.num_decodes
        for lo, hi in ((0, nd), (nd, len(order))):
            if hi > lo:
                start = int(ends[lo - 1]) if lo else 0
                groups.append(build_attention_group(start, nsched[lo:hi], context[lo:hi], batch.block_table[rows[lo:hi]], B, self.device))

        dev = self.device
        meta = AttentionMetadata(torch.from_numpy(slots).to(dev), groups, B)
        lora = None
        if self.lora_manager is not None:
            req_lora = np.fromiter((self.requests[r].lora_int_id for r in order), dtype=np.int64, count=len(order))
            lora = self.lora_manager.prepare_step(np.repeat(req_lora, nsched))
        hidden = self.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), self.kv_caches, meta, lora)

        out = ModelRunnerOutput()
        if self.pooling_type is not None:
            self._pool(order, rows, nsched, context, ends, hidden, out)
            return out
        self._prompt_logprobs(order, rows, nsched, context, ends, hidden, out)
        # A request samples when its chunk (less its drafts) reaches the end of the tokens the worker holds.
        ndraft = np.fromiter((len(spec.get(r, ())) for r in order), dtype=np.int64, count=len(order)) if spec else 0
        samples = context + nsched - ndraft == batch.num_tokens[rows]
        if spec:
            verify = samples & (ndraft > 0)
            self._verify_drafts([order[i] for i in np.flatnonzero(verify).tolist()], rows[verify], ends[verify], ndraft[verify], so, hidden, out)
            samples &= ~verify
        if not samples.any():
            return out
        sample_rows = rows[samples]
        sample_ids = [order[i] for i in np.flatnonzero(samples).tolist()]
        logits = self.model.compute_logits(hidden[torch.from_numpy(ends[samples] - 1).to(dev)])
        if logits is None:  # a tensor-parallel rank > 0: rank 0 samples and sends the tokens
            tokens = self.model.tp.broadcast(torch.empty(len(sample_rows), dtype=torch.int64, device=dev)).cpu().numpy()
            batch.append_sampled(sample_rows, tokens)
            return out
        grammar = self._grammar_rows(so, {rid: i for i, rid in enumerate(sample_ids)})
        if grammar is not None:  # structured output: forbid what the grammars forbid
            apply_grammar_bitmask(logits, *grammar)
        res = self.sampler(logits, batch.sampling_metadata(sample_rows))
        if self.model.tp is not None:
            self.model.tp.broadcast(res.sampled_token_ids.to(torch.int64).contiguous())
        tokens = res.sampled_token_ids.cpu().numpy()
        batch.append_sampled(sample_rows, tokens)
        out.sampled.update(zip(sample_ids, tokens.tolist()))
        if res.logprobs is not None:
            lp = res.logprobs.tolist()
            ids = res.logprob_token_ids.tolist()
            ranks = res.sampled_ranks.tolist()
            for i, (rid, row) in enumerate(zip(sample_ids, sample_rows.tolist())):
                k = int(batch.num_logprobs[row])
                if k >= 0:
                    out.logprobs[rid] = [(ids[i][: k + 1], lp[i][: k + 1], ranks[i])]
        return out

    @staticmethod
    def _grammar_rows(so: SchedulerOutput, first_row: dict[str, int]) -> Optional[tuple[list[int], bytes]]:
        """The rows of ``so.grammar_bitmask`` of the requests in ``first_row``, as (the logits
        rows they mask, their bitmask bytes): a request's j-th bitmask row masks logits row
        ``first_row[rid] + j`` (j > 0: after its drafts). None when there are none."""
        ids = so.structured_output_request_ids
        if so.grammar_bitmask is None or not ids:
            return None
        pick, rows, seen = [], [], {}
        for i, rid in enumerate(ids):
            if rid in first_row:
                j = seen[rid] = seen.get(rid, -1) + 1
                pick.append(i)
                rows.append(first_row[rid] + j)
        if not pick:
            return None
        mask = np.frombuffer(so.grammar_bitmask, dtype="<i4").reshape(len(ids), -1)
        return rows, (mask if len(pick) == len(ids) else mask[pick]).tobytes()

    def _verify_drafts(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        ends: np.ndarray,
        ndraft: np.ndarray,
        so: SchedulerOutput,
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Speculative decoding: score each request's last token and drafts (its chunk's last
        ``1 + k`` rows of ``hidden``), keep the drafts its sampling accepts and append them and
        the token after them to its row (see :mod:`pagedserve.model.rejection_sampler`). Row
        ``j`` of a request is processed as if drafts ``0 .. j-1`` were already output
        (penalties, bad words, min_tokens; a grammar's mask per row comes with ``so``); logprobs
        are given for every appended token."""
        batch = self.input_batch
        spec = so.scheduled_spec_decode_tokens
        hrows = np.concatenate([np.arange(e - 1 - k, e) for e, k in zip(ends.tolist(), ndraft.tolist())])
        logits = self.model.compute_logits(hidden[torch.from_numpy(hrows).to(self.device)])
        draft_ids = [t for rid in req_ids for t in (*spec[rid], -1)]
        before = np.concatenate([np.arange(k + 1) for k in ndraft.tolist()])
        firsts = np.concatenate([[0], np.cumsum(ndraft + 1)[:-1]]).tolist()
        grammar = self._grammar_rows(so, dict(zip(req_ids, firsts)))
        if grammar is not None:
            apply_grammar_bitmask(logits, *grammar)
        meta = batch.sampling_metadata(np.repeat(rows, ndraft + 1), before)
        kept, tokens = rejection_sample(
            logits, meta, torch.tensor(draft_ids, dtype=torch.int64, device=self.device), ndraft.tolist(), self.model.backend.argmax
        )
        for rid, row, a, tok in zip(req_ids, rows.tolist(), kept, tokens):
            n = int(batch.num_tokens[row]) + a  # the kept drafts are already in place
            batch.token_ids[row, n] = tok
            batch.num_tokens[row] = n + 1
            out.sampled[rid] = tok
            out.num_accepted_tokens[rid] = a
        if meta.max_num_logprobs is not None:
            appended = [spec[rid][:a] + [tok] for rid, a, tok in zip(req_ids, kept, tokens)]
            self._verified_logprobs(req_ids, rows, firsts, appended, logits, out)

    def _verified_logprobs(
        self, req_ids: list[str], rows: np.ndarray, firsts: list[int], appended: list[list[int]], logits: torch.Tensor, out: ModelRunnerOutput
    ) -> None:
        """Raw logprobs of each token a verified decode appended (``appended[i]``: its kept drafts
        and the token after them, scored by logits rows ``firsts[i] ..``), for the requests that
        asked."""
        batch = self.input_batch
        asking = [i for i, row in enumerate(rows.tolist()) if batch.num_logprobs[row] >= 0]
        lrows = [firsts[i] + j for i in asking for j in range(len(appended[i]))]
        toks = [t for i in asking for t in appended[i]]
        k_max = int(batch.num_logprobs[rows[asking]].max())
        raw = torch.log_softmax(logits[torch.tensor(lrows, device=logits.device)].float(), dim=-1)
        lp, ids, ranks = (t.tolist() for t in gather_logprobs(raw, torch.tensor(toks, device=logits.device), k_max))
        at = 0
        for i in asking:
            k, n = int(batch.num_logprobs[rows[i]]), len(appended[i])
            out.logprobs[req_ids[i]] = [(ids[j][: k + 1], lp[j][: k + 1], ranks[j]) for j in range(at, at + n)]
            at += n

    def _pool(
        self,
        order: list[str],
        rows: np.ndarray,
        nsched: np.ndarray,
        context: np.ndarray,
        ends: np.ndarray,
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Pooling runner: fold this step's chunk of each prompt into its pooled state (MEAN: a
        float32 running sum of the rows; CLS: the row of position 0; LAST: nothing until the
        end) and, for each request whose chunk ends its prompt, put the pooled vector
        ``[hidden_size]`` (MEAN: the sum over the prompt's length) in ``out.pooled`` as
        little-endian float32 bytes. A chunk that starts at position 0 starts over (a request
        recomputed after preemption)."""
        batch = self.input_batch
        kind = self.pooling_type
        done = context + nsched >= batch.num_prompt_tokens[rows]
        for i, rid in enumerate(order):
            state = self.requests[rid]
            lo, hi = int(ends[i] - nsched[i]), int(ends[i])
            if kind == "MEAN":
                part = hidden[lo:hi].float().sum(0)
                state.pooled = part if context[i] == 0 or state.pooled is None else state.pooled + part
            elif kind == "CLS" and context[i] == 0:
                state.pooled = hidden[lo].float()
            if not done[i]:
                continue
            if kind == "LAST":
                vec = hidden[hi - 1].float()
            elif kind == "MEAN":
                vec = state.pooled / float(batch.num_prompt_tokens[rows[i]])  # type: ignore[operator]
            else:
                vec = state.pooled  # type: ignore[assignment]
            state.pooled = None
            out.pooled[rid] = vec.cpu().numpy().astype("<f4").tobytes()

    # Rows of logits scored at once for prompt logprobs: [rows, vocab] float32 (49k vocab: 100 MB).
    PROMPT_LOGPROBS_ROWS = 512

    def _prompt_logprobs(
        self,
        order: list[str],
        rows: np.ndarray,
        nsched: np.ndarray,
        context: np.ndarray,
        ends: np.ndarray,
        hidden: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Prompt logprobs (vLLM's ``prompt_logprobs``) of the prompt positions in this step's
        chunks: position ``p`` scores prompt token ``p + 1`` under the raw distribution, for
        ``p`` up to ``num_prompt_tokens - 2``. Each position once: a chunk recomputed after
        preemption skips what was sent. Under tensor parallelism every rank calls
        ``compute_logits`` alike (the decision uses only the message) and rank 0 keeps them."""
        if not self.prompt_logprob_reqs:
            return
        batch = self.input_batch
        todo = []  # (request id, k, hidden rows, target token ids)
        for i, rid in enumerate(order):
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            row, ctx = int(rows[i]), int(context[i])
            lo = max(ctx, state.num_prompt_logprobs_done)
            hi = min(ctx + int(nsched[i]), int(batch.num_prompt_tokens[row]) - 1)
            if hi <= lo:
                continue
            state.num_prompt_logprobs_done = hi
            start = int(ends[i] - nsched[i]) - ctx
            todo.append((rid, k, np.arange(start + lo, start + hi), batch.token_ids[row, lo + 1 : hi + 1]))
        for rid, k, hrows, targets in todo:
            ids, lps, ranks = [], [], []
            for a in range(0, len(hrows), self.PROMPT_LOGPROBS_ROWS):
                sl = slice(a, a + self.PROMPT_LOGPROBS_ROWS)
                logits = self.model.compute_logits(hidden[torch.from_numpy(hrows[sl]).to(self.device)])
                if logits is None:  # a tensor-parallel rank > 0
                    continue
                lp, tid, rk = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), torch.from_numpy(targets[sl].copy()).to(self.device), k)
                lps += lp.tolist()
                ids += tid.tolist()
                ranks += rk.tolist()
            if ids:
                out.prompt_logprobs[rid] = (ids, lps, ranks)
