"""EngineConfig: everything that shapes an engine instance, with vLLM's names, and its CLI
flags, defined once here (vLLM's ``EngineArgs.add_cli_args`` / ``from_cli_args`` shape).

``LLM(model, **kwargs)``, ``pagedserve generate|chat|serve|bench`` and the server's engine
process all build the same :class:`EngineConfig`. Values the engine resolves at start-up
(``max_model_len`` from the model and the KV cache, the token budget) are filled into a copy by
:meth:`EngineConfig.resolved`, so the scheduler reads one config, never a second one.
Torch-free: the engine core imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from pagedserve.config_cli import _flag, add_dataclass_flags
from pagedserve.kv_transfer_config import KVTransferConfig
from pagedserve.lora_request import parse_lora_modules
from pagedserve.pooler_config import RUNNERS, PoolerConfig, parse_pooler_config, pooler_config_dict
from pagedserve.spec_decode_config import SpeculativeConfig

DEFAULT_TOKEN_BUDGET = 2048
# max_num_seqs when left unset, by the device the model runs on (vLLM's CUDA default is 256).
DEFAULT_MAX_NUM_SEQS = {"cpu": 64, "cuda": 256}
# Step-time target (ms): see docs/perf-history.md, "Issue 15: bounded step time", for the choice.
SERVING_MAX_STEP_MS = 200.0  # the server's default; offline engines default to off (as vLLM's usage-context defaults)
# A prefilling step may also last this many times its decodes alone (docs/perf-history.md,
# "Issue 15: a step target relative to the decodes").
DEFAULT_MAX_STEP_DECODE_MULTIPLE = 4.0

T = TypeVar("T")


def dataclass_from_value(cls: type[T], value: Any, name: str) -> T:
    """``cls`` (a config dataclass such as :class:`KVTransferConfig` or :class:`SpeculativeConfig`)
    from an instance of it, a dict or a JSON object's text (``--kv-transfer-config``,
    ``--speculative-config``); ``name`` is the field the errors name, in vLLM's style.

    Raises:
        ValueError: invalid JSON, not an object, or a key ``cls`` does not have (and whatever
            ``cls`` raises for its values).
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**value)


@dataclass
class EngineConfig:
    """Configuration of one engine (model, KV cache, scheduler, process layout).

    Attributes:
        model: HF model directory or .gguf file; None = the default SmolLM2-135M-Instruct.
        dtype: "auto" (bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AVX2 + FMA, else float32),
            "float32", "bfloat16" or "float16". Weights and KV cache use it; with quantized
            weights it is the activations' type.
        quantization: None (weights as the checkpoint stores them: a quantized GGUF file stays
            quantized on the CPU, see ``pagedserve.ops.quantized``; dequantized in memory on
            CUDA), "none" (every weight dequantized to ``dtype`` in memory, for exact comparisons
            with HF transformers) or "int8" (vLLM's flag; the value is ours: the projections of
            a float checkpoint become symmetric int8 per output channel at load time; weights
            that are already quantized stay as they are). fp8 is refused with a hint.
        kv_cache_dtype: "auto" (the KV cache in ``dtype``) or "int8": K and V stored as int8
            with one float32 scale per token and KV head (symmetric, max |x| / 127), dequantized
            inside attention; about 1.9x the blocks in the same memory for head_dim 64. vLLM's
            fp8 choices are refused (no fp8 arithmetic on these CPUs).
        runner: "generate" (text generation; "auto" means it too) or "pooling" (vLLM's
            ``--runner pooling``: the model turns prompts into embeddings, ``LLM.embed`` and
            ``/v1/embeddings``; generation requests are refused). See :mod:`pagedserve.pooler_config`.
        pooler_config: with ``runner="pooling"``, ``{"pooling_type": "LAST"|"MEAN"|"CLS",
            "normalize": bool}`` (a dict or JSON text); unset keys come from the checkpoint's
            sentence-transformers files, else LAST and normalize. Resolved at start-up into a
            dict with every key filled in. Prefix caching stays on only with LAST pooling (MEAN
            and CLS need every prompt position computed).
        enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_modules: multi-LoRA serving
            (vLLM's flags; see :mod:`pagedserve.worker.lora_manager`). ``max_loras``: adapters a
            step may run (resident slots, LRU); ``max_lora_rank``: the largest rank accepted;
            ``max_cpu_loras``: adapters registered (loaded in memory) at once, None = 4 x
            ``max_loras``; ``lora_modules`` (the server's): ``name=path`` or JSON
            ``{"name", "path", "base_model_name"}`` entries registered at start.
        block_size: tokens per KV cache block.
        max_model_len: longest sequence (prompt + output, tokens); None = the model's
            max_position_embeddings, lowered to what the KV cache can hold.
        max_num_seqs: most requests running at once; None = by device (64 on CPU, 256 on
            CUDA), resolved at start-up (:meth:`resolved`).
        max_num_batched_tokens: token budget of one step (tokens); None = 2048 (with chunked
            prefill off: at least max_model_len).
        kv_cache_memory_bytes: KV cache budget (bytes); None = a share of free memory
            (CPU: 20 % of available RAM, at most 4 GiB; CUDA: gpu_memory_utilization).
        num_kv_blocks: set the pool size directly (blocks); overrides the memory budget.
        gpu_memory_utilization: fraction of GPU memory the engine may use (CUDA only): it
            bounds weights + the peak of a profiling forward + the KV cache, as in vLLM.
        enforce_eager: CUDA only (vLLM's flag): no CUDA graphs, every step eager. Default True
            until a GPU run has shown graph replay equal to eager; ``--no-enforce-eager``
            captures decode-only steps as CUDA graphs at padded batch sizes (untested on a GPU,
            see ``pagedserve.worker.cuda_graphs``). No effect on the CPU.
        enable_prefix_caching: reuse KV blocks across requests by chained block hashes.
        enable_chunked_prefill: split long prompts across steps under the token budget.
        long_prefill_token_threshold: cap on one request's prefill chunk per step (0 = none).
        scheduling_policy: "fcfs" (waiting requests in arrival order; a request's ``priority``
            must be 0) or "priority" (smaller ``priority`` first, then arrival; when blocks run
            out the running request with the largest ``(priority, arrival)`` is preempted
            first), as vLLM's ``--scheduling-policy``.
        max_step_ms: step-time target (milliseconds; 0 = off, the fixed token budget alone;
            None = the entry point's default: ``SERVING_MAX_STEP_MS`` (200) for the server's
            ``AsyncLLM``, off for the offline ``LLM`` and ``bench throughput``, whose figure is
            throughput; vLLM likewise picks ``max_num_batched_tokens`` by usage context). The scheduler sizes prefill chunks from the step cost it measures (see
            ``pagedserve.core.sched.step_cost``) so that a step's predicted wall time stays under
            it, whether or not decodes run beside the prefill; the token budget still caps a
            step. Decodes are never held back for it and a step's first prefill chunk always
            gets at least max(16, block_size) tokens, so a target below the decode step time
            slows prefills but starves nobody. No effect with chunked prefill off.
        max_step_decode_multiple: with ``max_step_ms`` on, a step that prefills may last up to
            this many times the predicted time of its decodes alone (of a one-token step when
            none run) where that is longer than ``max_step_ms``: the target of a step is
            ``max(max_step_ms, multiple x predicted decodes-alone time)``. Where one decode step
            nears ``max_step_ms`` (a big model, a slow CPU) prefill would otherwise get a few
            tokens per step; running streams slow down at most this many times while prompts
            are prefilled. 0 = ``max_step_ms`` alone (a fixed bound); else >= 1. Default 4.
        seed: global seed (sampling of requests without their own seed).
        device: "auto" (CUDA when available, else CPU), "cpu" or "cuda[:i]".
        served_model_name: names the API answers to (a string is one name); the first is the
            one reported; default: the model's folder or file name.
        tokenizer: an HF tokenizer folder to use instead of the model's.
        num_threads: torch CPU threads of the engine (the process that runs the model);
            None = one per core this process may run on.
        trace_buffer_steps: step records the engine core keeps in its ring buffer for
            ``get_step_trace`` (steps; 0 = none kept; see ``pagedserve.core.trace``).
        kv_transfer_config: a :class:`KVTransferConfig` as a dict (or JSON text), or None (no
            disaggregation). Stored as a plain dict with every key filled in (the engine-core
            process receives the config as JSON).
        trace_file: write one JSON record per step to this file (JSON lines, flushed each
            step; the file is truncated when the engine starts), or None. Written by the
            process that runs the engine core.
        speculative_config: a :class:`SpeculativeConfig` as a dict (or JSON text), or None (no
            speculative decoding). n-gram drafts verified in one pass; greedy output is
            unchanged (bit for bit on the bf16 CPU kernels, elsewhere up to rounding). Stored
            as a plain dict with every key filled in.
        tensor_parallel_size: ranks the model is sharded over (Megatron-style: attention heads,
            KV heads and the KV cache, MLP width, vocabulary); it must divide the query and KV
            head counts and the MLP width. 1 = the engine runs the model in its own process.
        distributed_executor_backend: how ranks 1..N-1 run: "mp" (subprocesses of the engine
            core) or "ray" (Ray actors; the running Ray instance, else ``ray.init()``, which
            honours ``RAY_ADDRESS``). Rank 0 is always the engine core's process.
        distributed_host: address the tensor-parallel rendezvous (torch.distributed store,
            gloo) and control sockets bind to; None = 127.0.0.1 (set this node's address for
            Ray workers on other nodes).
        data_parallel_size, data_parallel_backend, ray_address, threads_per_replica,
            pin_replica_cores, router: data parallelism of the server (``AsyncLLM``): N engine
            replicas behind one front, see ``pagedserve.engine.dp_client``. Backend "mp"
            (processes on this host) or "ray" (Ray actors in placement groups; ``ray_address``
            "auto" or host:port joins a running cluster, None starts a local head for the
            server's lifetime). ``threads_per_replica``: torch threads of each replica (None =
            ``num_threads``, else the usable cores divided by N, at least 1); with "mp" and
            ``pin_replica_cores`` each replica is pinned to its own cores when N x threads fit.
            ``router``: "kv-aware" (the replica holding the longest cached prefix, traded
            against queue length; see ``pagedserve.distributed.dp_router``), "least-loaded" or
            "round-robin". The replicas themselves run with data_parallel_size 1.
    """

    model: Optional[str] = field(default=None, metadata=_flag("HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"))
    dtype: str = field(default="auto", metadata=_flag("weights and KV cache dtype", choices=["auto", "float32", "bfloat16", "float16"]))
    quantization: Optional[str] = field(
        default=None,
        metadata=_flag(
            "weights: unset = as the checkpoint stores them (a quantized GGUF stays quantized), none = dequantized in memory, "
            "int8 = float projections quantized to int8 per output channel at load",
            "--quantization",
            "-q",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_flag(
            "KV cache storage: auto (the model's dtype) or int8 (per-token, per-head scales; about half the bytes)", choices=["auto", "int8"]
        ),
    )
    runner: str = field(
        default="auto", metadata=_flag("generate (text) or pooling (embeddings: /v1/embeddings, LLM.embed); auto = generate", choices=list(RUNNERS))
    )
    pooler_config: Optional[dict] = field(
        default=None,
        metadata=_flag(
            'with --runner pooling, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true|false} (default: the checkpoint\'s sentence-transformers config, else LAST, normalized)'
        ),
    )
    enable_lora: bool = field(default=False, metadata=_flag("serve LoRA adapters (--lora-modules, per-request lora_request)"))
    max_loras: int = field(default=4, metadata=_flag("LoRA adapters one step may run (resident slots, LRU)"))
    max_lora_rank: int = field(default=16, metadata=_flag("largest LoRA rank accepted"))
    max_cpu_loras: Optional[int] = field(default=None, metadata=_flag("LoRA adapters registered in memory at once (default 4 x --max-loras)"))
    lora_modules: Optional[list[str]] = field(
        default=None,
        metadata=_flag('LoRA adapters served at start: name=path or JSON {"name", "path", "base_model_name"}', nargs="+", only="serve"),
    )
    block_size: int = field(default=16, metadata=_flag("tokens per KV cache block"))
    max_model_len: Optional[int] = field(default=None, metadata=_flag("longest prompt + output (tokens)"))
    max_num_seqs: Optional[int] = field(default=None, metadata=_flag("most requests running at once (default: 64 on CPU, 256 on CUDA)"))
    max_num_batched_tokens: Optional[int] = field(default=None, metadata=_flag("token budget per step"))
    kv_cache_memory_bytes: Optional[int] = field(
        default=None, metadata=_flag("KV cache budget in bytes", "--kv-cache-memory", "--kv-cache-memory-bytes")
    )
    num_kv_blocks: Optional[int] = field(default=None, metadata=_flag("KV cache pool size in blocks (overrides the memory budget)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_flag("fraction of GPU memory the engine may use"))
    enforce_eager: bool = field(
        default=True,
        metadata=_flag("CUDA: no CUDA graphs (the default for now; --no-enforce-eager captures decode steps as graphs, untested on a GPU)"),
    )
    enable_prefix_caching: bool = field(default=True, metadata=_flag("reuse KV blocks of shared prefixes"))
    enable_chunked_prefill: bool = field(default=True, metadata=_flag("split long prompts under the token budget"))
    long_prefill_token_threshold: int = field(default=0, metadata=_flag("cap on one request's prefill chunk per step (0 = none)"))
    scheduling_policy: str = field(
        default="fcfs",
        metadata=_flag(
            "fcfs (arrival order) or priority (a request's priority, smaller first, then arrival; the largest is preempted first)",
            choices=["fcfs", "priority"],
        ),
    )
    max_step_ms: Optional[float] = field(
        default=None,
        metadata=_flag(
            "step-time target in ms: prefill chunks are sized from the measured step cost to keep each step under it "
            f"(0 = off; default: {SERVING_MAX_STEP_MS:g} for serve, off offline)"
        ),
    )
    max_step_decode_multiple: float = field(
        default=DEFAULT_MAX_STEP_DECODE_MULTIPLE,
        metadata=_flag(
            "with --max-step-ms on, a prefilling step may also last this many times its decodes alone "
            "(the step target is the larger of the two; 0 = --max-step-ms alone)"
        ),
    )
    seed: int = field(default=0, metadata=_flag("global sampling seed"))
    device: str = field(default="auto", metadata=_flag("auto, cpu or cuda"))
    served_model_name: Optional[list[str]] = field(
        default=None, metadata=_flag("model name(s) the API answers to (the first is reported)", nargs="+", only="serve")
    )
    tokenizer: Optional[str] = field(default=None, metadata=_flag("tokenizer folder (default: the model's)"))
    num_threads: Optional[int] = field(default=None, metadata=_flag("torch CPU threads of the engine (default: one per core)"))
    trace_buffer_steps: int = field(default=1024, metadata=_flag("step records kept for get_step_trace (0 = off)"))
    trace_file: Optional[str] = field(default=None, metadata=_flag("write one JSON line per engine step to this file"))
    kv_transfer_config: Optional[dict] = field(
        default=None,
        metadata=_flag(
            'prefill/decode disaggregation, as JSON: {"kv_role": "kv_producer"|"kv_consumer"|"kv_both", "kv_ip": ..., '
            '"kv_port": ..., "kv_load_failure_policy": "recompute"|"fail", "kv_lease_s": 30, ...}',
            only="serve",
        ),
    )
    speculative_config: Optional[dict] = field(
        default=None,
        metadata=_flag(
            'speculative decoding by n-gram lookup, as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}; num_speculative_tokens (1-16) is required; prompt_lookup_max/min '
            "(1-64) default to 5 and 5 (one sets both); disable_by_batch_size: no drafts from that many running requests"
        ),
    )
    # -- tensor parallelism --
    tensor_parallel_size: int = field(default=1, metadata=_flag("ranks the model is sharded over", "--tensor-parallel-size", "-tp"))
    distributed_executor_backend: str = field(default="mp", metadata=_flag("how tensor-parallel ranks run", choices=["mp", "ray"]))
    distributed_host: Optional[str] = field(
        default=None, metadata=_flag("address the tensor-parallel rendezvous and control sockets bind to (default 127.0.0.1)")
    )
    # -- data parallelism (the server's front reads these; each replica runs with size 1) --
    data_parallel_size: int = field(default=1, metadata=_flag("engine replicas behind the server", "--data-parallel-size", "-dp", only="serve"))
    data_parallel_backend: str = field(
        default="mp",
        metadata=_flag(
            "where replicas run: mp (processes on this host) or ray (Ray actors, across a Ray cluster's nodes)", choices=["mp", "ray"], only="serve"
        ),
    )
    ray_address: Optional[str] = field(
        default=None,
        metadata=_flag("Ray cluster to join (auto, or head host:port); default: start a local Ray head for the server's lifetime", only="serve"),
    )
    threads_per_replica: Optional[int] = field(
        default=None, metadata=_flag("torch threads of each replica (default: --num-threads, else usable cores / replicas)", only="serve")
    )
    pin_replica_cores: bool = field(default=True, metadata=_flag("mp backend: pin each replica to its own cores when they fit", only="serve"))
    router: str = field(
        default="kv-aware",
        metadata=_flag(
            "how requests pick a replica: kv-aware (longest cached prefix, balanced against queue length), least-loaded or round-robin",
            choices=["kv-aware", "least-loaded", "round-robin"],
            only="serve",
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and (not self.served_model_name or not all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ValueError(f"served_model_name must be non-empty names, got {self.served_model_name!r}")

        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if (v is not None or not allow_none) and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be at least 1, got {v}")

        for name in ("max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads", "max_num_seqs"):
            positive(name)
        for name in ("block_size", "tensor_parallel_size", "data_parallel_size"):
            positive(name, allow_none=False)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}")
        if self.tensor_parallel_size > 1 and self.kv_transfer_config is not None:
            raise ValueError("tensor_parallel_size > 1 together with kv_transfer_config (prefill/decode disaggregation) is not supported")
        if self.data_parallel_size > 1 and self.kv_transfer_config is not None:
            raise ValueError(
                "data_parallel_size > 1 together with kv_transfer_config is not supported: the replicas would share one "
                "kv_port; run one instance per role and list several behind `pagedserve proxy`"
            )
        positive("threads_per_replica")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be mp or ray, got {self.data_parallel_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.router not in ("kv-aware", "least-loaded", "round-robin"):
            raise ValueError(f"router must be kv-aware, least-loaded or round-robin, got {self.router!r}")
        if not isinstance(self.trace_buffer_steps, int) or isinstance(self.trace_buffer_steps, bool) or self.trace_buffer_steps < 0:
            raise ValueError(f"trace_buffer_steps must be >= 0, got {self.trace_buffer_steps}")
        if self.trace_file:
            import os

            folder = os.path.dirname(os.path.abspath(self.trace_file))
            if os.path.isdir(self.trace_file) or not os.path.isdir(folder):
                raise ValueError(f"trace_file {self.trace_file!r}: not a file path in an existing folder")
        if self.max_step_ms is not None and (
            isinstance(self.max_step_ms, bool)
            or not isinstance(self.max_step_ms, (int, float))
            or not math.isfinite(self.max_step_ms)
            or self.max_step_ms < 0
        ):
            raise ValueError(f"max_step_ms must be a number of milliseconds >= 0 (0 = off), got {self.max_step_ms!r}")
        if self.max_step_ms is not None:
            self.max_step_ms = float(self.max_step_ms)
        m = self.max_step_decode_multiple
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or (m != 0 and m < 1):
            raise ValueError(f"max_step_decode_multiple must be 0 (max_step_ms alone) or a number >= 1, got {m!r}")
        self.max_step_decode_multiple = float(m)
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = dataclasses.asdict(dataclass_from_value(KVTransferConfig, self.kv_transfer_config, "kv_transfer_config"))
        if self.speculative_config is not None:
            self.speculative_config = dataclasses.asdict(dataclass_from_value(SpeculativeConfig, self.speculative_config, "speculative_config"))
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config together with tensor_parallel_size > 1 is not supported")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.runner == "auto":
            self.runner = "generate"
        if self.pooler_config is not None:
            if self.runner != "pooling":
                raise ValueError("pooler_config is only used with runner='pooling' (--runner pooling)")
            self.pooler_config = pooler_config_dict(parse_pooler_config(self.pooler_config))
        if self.runner == "pooling":
            for name, what in (("speculative_config", "speculative decoding"), ("kv_transfer_config", "prefill/decode disaggregation")):
                if getattr(self, name) is not None:
                    raise ValueError(f"runner='pooling' produces no tokens, so {name} ({what}) does not apply")
        for name in ("max_loras", "max_lora_rank"):
            positive(name, allow_none=False)
        positive("max_cpu_loras")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.lora_modules is not None:
            if isinstance(self.lora_modules, str):
                self.lora_modules = [self.lora_modules]
            if not self.enable_lora:
                raise ValueError("lora_modules needs enable_lora (--enable-lora)")
            parse_lora_modules(self.lora_modules)  # ValueError on a malformed entry
        if self.enable_lora:
            for bad, why in (
                (self.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
                (self.runner == "pooling", "runner='pooling'"),
            ):
                if bad:
                    raise ValueError(f"enable_lora together with {why} is not supported")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "none", "int8"):
            q = str(self.quantization)
            hint = " (fp8 weights are not supported on these CPUs; int8 keeps 1 byte per weight)" if q.startswith("fp8") else ""
            raise ValueError(f"quantization must be unset, none or int8, got {self.quantization!r}{hint}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            hint = " (fp8 KV caches are not supported here; int8 halves the bytes the same way)" if str(self.kv_cache_dtype).startswith("fp8") else ""
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}{hint}")

    # -- values resolved at start-up --------------------------------------------------------
    def resolved(self, max_model_len: int, device_type: str = "cpu") -> "EngineConfig":
        """A copy with ``max_model_len``, ``max_num_batched_tokens`` and ``max_num_seqs`` filled
        in (the budget defaults to 2048 tokens, and with chunked prefill off to at least
        max_model_len; max_num_seqs by ``device_type``, see :meth:`max_num_seqs_for`)."""
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.token_budget_for(max_model_len),
            max_num_seqs=self.max_num_seqs_for(device_type),
        )

    def token_budget_for(self, max_model_len: int) -> int:
        """``max_num_batched_tokens``, or its default for ``max_model_len``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_TOKEN_BUDGET if self.enable_chunked_prefill else max(DEFAULT_TOKEN_BUDGET, max_model_len)

    def max_num_seqs_for(self, device_type: str) -> int:
        """``max_num_seqs``, or its default on a ``device_type`` ("cpu", "cuda") device:
        :data:`DEFAULT_MAX_NUM_SEQS` (64 for any device but CUDA)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return DEFAULT_MAX_NUM_SEQS.get(device_type, DEFAULT_MAX_NUM_SEQS["cpu"])

    def verify_token_budget(self) -> None:
        """Raises ValueError when, with chunked prefill off, a prompt of max_model_len tokens
        could never be scheduled (call on a resolved config)."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )

    @property
    def kv_transfer(self) -> Optional[KVTransferConfig]:
        """The parsed ``kv_transfer_config`` (None without disaggregation)."""
        return KVTransferConfig(**self.kv_transfer_config) if self.kv_transfer_config is not None else None

    @property
    def pooler(self) -> Optional[PoolerConfig]:
        """The parsed ``pooler_config`` (None unless ``runner="pooling"``)."""
        if self.runner != "pooling":
            return None
        return parse_pooler_config(self.pooler_config)

    @property
    def lora_capacity(self) -> int:
        """Adapters that may be registered at once (``max_cpu_loras``, default 4 x ``max_loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """The parsed ``speculative_config`` (None without speculative decoding)."""
        return SpeculativeConfig(**self.speculative_config) if self.speculative_config is not None else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- CLI --------------------------------------------------------------------------------
    def with_serving_defaults(self) -> "EngineConfig":
        """A copy with the online server's defaults filled in where a field is left at None
        (today: ``max_step_ms`` = ``SERVING_MAX_STEP_MS``)."""
        if self.max_step_ms is not None:
            return self
        return dataclasses.replace(self, max_step_ms=SERVING_MAX_STEP_MS)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_flag: bool = True, usage: Optional[str] = "offline") -> None:
        """Add the fields of ``usage`` as flags (``--max-num-seqs``, ``--[no-]enable-prefix-caching``,
        ...) in an "engine" group; see :func:`pagedserve.config_cli.add_dataclass_flags`.
        ``model_flag=False`` leaves ``--model`` out (``serve`` takes the model as a positional
        argument and also accepts ``--model``, added by the caller)."""
        add_dataclass_flags(EngineConfig, parser, usage, skip=() if model_flag else ("model",))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        """The config the parsed flags describe; ``overrides`` win (e.g. a positional model)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
