"""LLMEngine: the synchronous core loop ``schedule() -> execute_model() -> update_from_output()``
plus the frontend work around it (tokenize, validate, detokenize incrementally, stop strings,
outputs). ``LLM`` (offline) and the HTTP server both drive one of these.
"""
from __future__ import annotations

import logging
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.model import loader
from pagedserve.model.llama import LlamaForCausalLM, RotaryEmbedding
from pagedserve.model.packed_linear import packing_available
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block

logger = logging.getLogger("pagedserve")

PromptType = Union[str, list[int], dict[str, Any]]

DEFAULT_CPU_KV_FRACTION = 0.2
DEFAULT_CPU_KV_MAX_BYTES = 4 << 30


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _sliding_window(hf_config) -> Optional[int]:
    """The checkpoint's attention window (tokens) when any layer uses one, else None
    (Mistral v0.1's ``sliding_window``; Qwen2/3 only with ``use_sliding_window``)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if hf_config.model_type in ("qwen2", "qwen3"):
        return int(window) if getattr(hf_config, "use_sliding_window", False) else None
    return int(window)


@dataclass
class _Child:
    """One of the n sequences of a request, with its frontend state."""

    request: Request
    detok: IncrementalDetokenizer
    num_tokens_sent: int = 0
    cumulative_logprob: float = 0.0
    logprobs: Optional[list[dict[int, Logprob]]] = None


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child] = field(default_factory=list)

    def finished(self) -> bool:
        return all(c.request.is_finished() for c in self.children)


class LLMEngine:
    """Loads a model, sizes the KV cache and steps requests to completion.

    Raises:
        ValueError: on an invalid configuration (e.g. max_model_len larger than the model's
            context or than the KV cache can hold).
        FileNotFoundError: when the model path does not exist.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.monotonic()
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={config.device!r}, but this torch build has no CUDA device available")
        self.model_dir = loader.resolve_model(config.model)
        self.hf_config = loader.load_config(self.model_dir)
        self.tokenizer = loader.load_tokenizer(self.model_dir)
        self.eos_token_ids = loader.load_eos_token_ids(self.model_dir, self.hf_config, self.tokenizer)
        self.dtype = loader.resolve_dtype(config.dtype, self.device)
        self.vocab_size = self.hf_config.vocab_size
        if config.served_model_name:
            self.model_name = config.served_model_name
        elif config.model is None:
            self.model_name = loader.DEFAULT_MODEL_NAME
        else:
            self.model_name = os.path.basename(os.path.normpath(config.model))
        if config.seed is not None:
            torch.manual_seed(config.seed)

        # KV cache size first: it may lower max_model_len.
        block_size = config.block_size
        block_bytes = kv_cache_bytes_per_block(self.hf_config, block_size, self.dtype)
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2048)
        window = _sliding_window(self.hf_config)
        if window is not None and window < max_pos:
            # Attention here is always full; it equals the checkpoint's sliding-window
            # attention only while sequences fit in the window.
            if config.max_model_len is not None and config.max_model_len > window:
                raise ValueError(
                    f"max_model_len={config.max_model_len} is larger than the model's sliding_window "
                    f"({window} tokens), which pagedserve does not implement"
                )
            logger.warning("Model uses sliding-window attention (%d tokens): max_model_len capped at %d", window, window)
            max_pos = window
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's context ({max_pos} tokens)")
        model = self._load_model(max_positions=config.max_model_len or max_pos)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_memory_bytes or self._default_kv_budget()
            num_blocks = budget // block_bytes
            if config.kv_cache_memory_bytes is None:
                # A default budget never needs more than every sequence at full length.
                max_len = min(max_pos, config.max_model_len or max_pos)
                num_blocks = min(num_blocks, config.max_num_seqs * -(-max_len // block_size))
            if num_blocks < 1:
                raise ValueError(f"KV cache budget of {budget} bytes is smaller than one block ({block_bytes} bytes)")
        capacity = num_blocks * block_size
        if config.max_model_len is None:
            self.max_model_len = min(max_pos, capacity)
        elif config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={config.max_model_len} tokens does not fit in the KV cache ({num_blocks} blocks "
                f"x {block_size} = {capacity} tokens); raise kv_cache_memory_bytes/num_kv_blocks or lower max_model_len"
            )
        else:
            self.max_model_len = config.max_model_len
        budget_tokens = config.max_num_batched_tokens
        if budget_tokens is None:
            budget_tokens = 2048 if config.enable_chunked_prefill else max(2048, self.max_model_len)
        if not config.enable_chunked_prefill and budget_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({budget_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.kv_cache_bytes = num_blocks * block_bytes
        self.runner = ModelRunner(model, num_blocks, block_size, self.device, self.dtype)
        identity = f"{os.path.abspath(self.model_dir)}|{self.dtype}"
        self.kv_manager = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, identity)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=budget_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
            ),
            self.kv_manager,
        )
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}
        self._counter = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self._last_log = time.monotonic()
        logger.info(
            "pagedserve: model %s (%s, %s on %s), KV cache %d blocks x %d tokens = %d tokens, %.1f MiB "
            "(%d bytes/token), max_model_len %d, token budget %d, loaded in %.1fs",
            self.model_name, self.hf_config.model_type, str(self.dtype).replace("torch.", ""), self.device,
            num_blocks, block_size, capacity, self.kv_cache_bytes / 2**20, block_bytes // block_size,
            self.max_model_len, budget_tokens, time.monotonic() - t0,
        )

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return max(0, int(total * self.config.gpu_memory_utilization) - used)
        return min(DEFAULT_CPU_KV_MAX_BYTES, int(_available_ram_bytes() * DEFAULT_CPU_KV_FRACTION))

    def _load_model(self, max_positions: int) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(self.hf_config, max_positions)
        model = model.to_empty(device=self.device)
        model.load_weights(loader.iterate_safetensors_weights(self.model_dir))
        model = model.to(self.dtype)
        # RoPE tables stay float32 (cast per step like HF does), built after the meta init.
        model.rotary_emb = RotaryEmbedding(self.hf_config, max_positions).to(self.device)
        if packing_available(self.device, self.dtype):
            model.pack_for_cpu()
        return model.eval()

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def _prompt_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):  # also numpy arrays, tensors
            return None, self._as_token_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _as_token_ids(ids) -> list[int]:
        """Token ids as Python ints (numpy / torch integers accepted). Raises ValueError otherwise."""
        try:
            return [operator.index(t) for t in ids]
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integers") from None

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        Raises:
            ValueError: naming the field: empty prompt, prompt too long for max_model_len, token
                ids outside the vocabulary, duplicate request_id, invalid sampling parameters.

        ``prompt`` may be a dict with ``prompt`` or ``prompt_token_ids`` and an optional
        ``cache_salt`` (requests with different salts never share prefix-cache blocks).
        """
        params = (params or SamplingParams()).clone()
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]  # vLLM accepts the salt inside the prompt dict too
        prompt_text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room to generate within max_model_len={self.max_model_len}"
            )
        params.verify_vocab(self.vocab_size)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet (logprobs of generated tokens are)")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        params._all_stop_token_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parent = _Parent(request_id, prompt_text, ids, params)
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, child_params, self.eos_token_ids, arrival_time, cache_salt)
            parent.children.append(_Child(req, IncrementalDetokenizer(self.tokenizer, ids, child_params), logprobs=[] if params.logprobs is not None else None))
        self._parents[request_id] = parent
        for c in parent.children:
            self._child_to_parent[c.request.request_id] = request_id
            self.scheduler.add_request(c.request)
        return request_id

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Abort requests (by the id add_request returned); their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for pid in request_ids:
            parent = self._parents.pop(pid, None)
            if parent is None:
                continue
            ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for rid in ids:
                self._child_to_parent.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return the outputs of requests that progressed."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        runner_out = self.runner.execute_model(sched_out)
        touched = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        # Prompt tokens count once per request (cached ones included), when prefill completes.
        self.num_prompt_tokens_total += sum(r.num_prompt_tokens for r in touched if r.num_output_tokens == 1)
        self.num_generation_tokens_total += len(touched)
        changed: dict[str, _Parent] = {}
        for req in touched:
            pid = self._child_to_parent.get(req.request_id)
            if pid is None:
                continue
            parent = self._parents[pid]
            child = next(c for c in parent.children if c.request is req)
            tok = req.output_token_ids[-1]
            if child.logprobs is not None and req.request_id in runner_out.logprobs:
                ids, lps, rank = runner_out.logprobs[req.request_id]
                entry = {ids[0]: Logprob(lps[0], rank, self.tokenizer.convert_ids_to_tokens(ids[0]))}
                for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                    if t not in entry:
                        entry[t] = Logprob(lp, r, self.tokenizer.convert_ids_to_tokens(t))
                child.logprobs.append(entry)
                child.cumulative_logprob += lps[0]
            stop_terminated = req.status == RequestStatus.FINISHED_STOPPED
            stop_str = child.detok.update([tok], stop_terminated)
            if stop_str is not None and not req.is_finished():
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop_str
            changed[pid] = parent
        outputs = []
        for pid, parent in changed.items():
            out = self._make_output(parent)
            if out is not None:
                outputs.append(out)
            if parent.finished():
                del self._parents[pid]
                for c in parent.children:
                    self._child_to_parent.pop(c.request.request_id, None)
        self._maybe_log_stats()
        return outputs

    def _make_output(self, parent: _Parent) -> Optional[RequestOutput]:
        kind = parent.params.output_kind
        finished = parent.finished()
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outs = []
        for i, c in enumerate(parent.children):
            req = c.request
            done = req.is_finished()
            text = c.detok.get_next_output_text(done, delta)
            start = c.num_tokens_sent if delta else 0
            token_ids = req.output_token_ids[start:]
            logprobs = c.logprobs[start:] if c.logprobs is not None else None
            c.num_tokens_sent = req.num_output_tokens
            if delta and not token_ids and not text and not done:
                continue
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        r0 = parent.children[0].request
        metrics = RequestMetrics(r0.arrival_time, r0.first_scheduled_time, r0.first_token_time, r0.last_token_time, r0.finished_time)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=max(0, r0.num_cached_tokens),
            metrics=metrics,
        )

    # -- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        """Counters for tests, logs and metrics (blocks, requests, preemptions, prefix cache)."""
        s = self.scheduler.get_stats()
        q, h = s.prefix_cache_queries, s.prefix_cache_hits
        return {
            "num_total_blocks": self.kv_manager.num_total_blocks,
            "num_free_blocks": self.kv_manager.num_free_blocks,
            "kv_cache_usage": self.kv_manager.usage(),
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": q,
            "prefix_cache_hits": h,
            "prefix_cache_hit_rate": (h / q) if q else 0.0,
            "num_prompt_tokens": self.num_prompt_tokens_total,
            "num_generation_tokens": self.num_generation_tokens_total,
            "num_unfinished_requests": len(self._parents),
        }

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefix blocks. Returns False (and does nothing) while requests hold blocks."""
        return self.kv_manager.reset_prefix_cache()

    def _maybe_log_stats(self, interval_s: float = 10.0) -> None:
        now = time.monotonic()
        if now - self._last_log < interval_s:
            return
        self._last_log = now
        s = self.get_stats()
        logger.info(
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"], 100 * s["prefix_cache_hit_rate"], s["num_preemptions"],
        )
