"""Worker: resolves the device, loads the model, sizes and allocates the KV cache, and runs
:class:`SchedulerOutput`s through its :class:`ModelRunner` (nano-vllm's ``ModelRunner.__init__``
shape: the worker sizes the cache itself and reports the number of blocks to the core).

With tensor parallelism one Worker runs per rank, each given the group: it shards the loaded
weights for its rank (``pagedserve.distributed.tensor_parallel``) and sizes a cache of its own KV
heads; the executor (``pagedserve.executor.tp_executor``) makes every rank agree on num_blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve import platform
from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import blocks_held_alone
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.distributed.parallel_state import TPGroup
from pagedserve.distributed.tensor_parallel import shard_checkpoint, shard_shapes
from pagedserve.lora_request import LoRARequest
from pagedserve.model import loader
from pagedserve.model.backends import select_backend
from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.packed_linear import packing_available
from pagedserve.model.quant_linear import QuantEmbedding, quantize_modules
from pagedserve.model.registry import model_class, sliding_window
from pagedserve.ops.cpu import quant_matmul
from pagedserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from pagedserve.worker.weights import WeightsInfo, dequantize_unlisted, describe_weights, quantize_int8

logger = logging.getLogger("pagedserve")

DEFAULT_CPU_KV_FRACTION = 0.2
DEFAULT_CPU_KV_MAX_BYTES = 4 << 30


def available_ram_bytes() -> int:
    """Available memory (bytes), 8 GiB when unknown."""
    return platform.available_memory_bytes() or 8 << 30


def resolve_device(device: str) -> torch.device:
    """Raises ValueError for a CUDA device this torch build cannot use."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this torch build has no CUDA device available")
    return dev


def _prepare_cpu_kernels() -> None:
    """Compile (first start only: a C compiler run per library, minutes in all on a small
    machine) or load the CPU kernels before the model needs them, saying so in the log."""
    import os

    from pagedserve.ops.cpu.build import get_decode_lib, get_fused_lib, get_lib

    if not platform.switch_on("PAGEDSERVE_CPU_KERNELS"):
        return
    where = os.path.join(platform.cache_dir(), "kernels")
    logger.info("pagedserve worker: preparing the CPU kernels (compiled on the first start only: minutes on a small machine; cached in %s)", where)
    t0 = time.monotonic()
    libs = [get_lib(), get_fused_lib(), get_decode_lib()]
    logger.info("pagedserve worker: CPU kernels %s in %.1fs", "ready" if all(libs) else "partly unavailable (see above)", time.monotonic() - t0)


@dataclass
class KVCacheSpec:
    """What the worker measured: the pool and the longest sequence it allows.

    Attributes:
        num_blocks: blocks in the pool.
        block_bytes: bytes of K and V of one block, all layers (all tensor-parallel ranks
            together: each holds 1/N).
        max_model_len: the model's context (capped by the pool), tokens.
        sliding_window: the window (tokens) when every layer has the same one (pure
            sliding-window attention: the core frees blocks that left it), else None.
    """

    num_blocks: int
    block_bytes: int
    max_model_len: int
    sliding_window: Optional[int] = None


class Worker:
    """Owns the device, the model and the KV cache.

    Args:
        config: the engine's config (``num_threads``: this process's torch threads).
        tp: this rank's tensor-parallel group, or None for a single worker.
    Raises:
        ValueError: invalid configuration (max_model_len larger than the model's context or
            than the KV cache holds, a budget below one block, an unsupported model, head
            counts that the tensor-parallel size does not divide).
        FileNotFoundError: the model path does not exist.
    """

    def __init__(self, config: EngineConfig, tp: Optional[TPGroup] = None) -> None:
        t0 = time.monotonic()
        self.config = config
        self.tp = tp
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = tp.device if tp is not None else resolve_device(config.device)
        self.model_dir = loader.resolve_model(config.model)
        self.hf_config = loader.load_config(self.model_dir)
        self.dtype = loader.resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.max_positions = self._max_positions()
        if config.enable_lora and not getattr(model_class(self.hf_config.model_type), "supports_lora", True):
            raise ValueError(
                f"enable_lora: LoRA is not supported for model_type {self.hf_config.model_type!r} (adapters name the Llama layer's modules)"
            )
        if self.device.type == "cpu" and (tp is None or tp.rank == 0):
            _prepare_cpu_kernels()
        logger.info("pagedserve worker: loading the weights from %s", self.model_dir)
        self.model = self._load_model(config.max_model_len or self.max_positions)
        self.kv_spec = self._size_kv_cache()
        self.model_runner: Optional[ModelRunner] = None
        self._model_identity: Optional[str] = None
        self.kv_connector = None  # prefill/decode disaggregation (initialize_cache)
        self.lora_manager = None
        if config.enable_lora:
            from pagedserve.worker.lora_manager import LoRAManager

            self.lora_manager = LoRAManager(
                self.hf_config, config.max_loras, config.max_lora_rank, self.device, str(config.model or self.model_dir), self.dtype
            )
        logger.info(
            "pagedserve worker: %s (%s) on %s, %s backend, %d torch threads, loaded in %.1fs",
            self.hf_config.model_type,
            str(self.dtype).replace("torch.", ""),
            self.device,
            self.model.backend.name,
            torch.get_num_threads(),
            time.monotonic() - t0,
        )

    @property
    def model_identity(self) -> str:
        """Folded into the prefix-cache hash seed: a cache never serves another model's KV, and
        two instances of one checkpoint (wherever it lives) name blocks alike (KV transfer)."""
        if self._model_identity is None:
            self._model_identity = f"{loader.model_fingerprint(self.model_dir)}|{self.dtype}|{self.weights.kind}"
        return self._model_identity

    def _max_positions(self) -> int:
        cfg = self.config
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2048)
        if cfg.max_model_len is not None and cfg.max_model_len > max_pos:
            raise ValueError(f"max_model_len={cfg.max_model_len} is larger than the model's context ({max_pos} tokens)")
        return max_pos

    def _load_model(self, max_positions: int) -> torch.nn.Module:
        cfg = self.config
        cls = model_class(self.hf_config.model_type)
        gguf = loader.gguf_source(self.model_dir)
        quant_modules: set[str] = set()
        if gguf is not None and cfg.quantization != "none":
            quant_modules = loader.gguf_quantized_modules(self.model_dir, cls.module_of)
            if quant_modules and self.device.type != "cpu":
                logger.info("%s: quantized weights are dequantized to %s in memory on %s", gguf, self.dtype, self.device)
                quant_modules = set()
        with torch.device("meta"):
            model = cls(self.hf_config, max_positions, tp=self.tp)
            if self.tp is not None:  # this rank's shapes: it never holds the whole model
                shard_shapes(model)
                quant_modules.discard("embed_tokens")  # the vocab-parallel embedding stays float
            quantize_modules(model, quant_modules)
            if self.device.type == "cuda":  # weights made in the target dtype: no float32 copy on the GPU
                model = model.to(self.dtype)
        model = model.to_empty(device=self.device)
        weights = loader.iterate_weights(self.model_dir, self.hf_config, quantized=bool(quant_modules))
        weights = dequantize_unlisted(weights, quant_modules, cls.module_of)
        if self.tp is not None:
            weights = shard_checkpoint(weights, self.hf_config, self.tp)
        model.load_weights(weights)
        model = model.to(self.dtype)
        if cfg.quantization == "int8":
            quantize_int8(model)
        for module in model.modules():
            if isinstance(module, QuantEmbedding):
                module.dtype = self.dtype
        # RoPE tables stay float32 (cast per step like HF does), built after the meta init.
        model.rotary_emb = getattr(cls, "rotary_embedding", RotaryEmbedding)(self.hf_config, max_positions).to(self.device)
        self.weights: WeightsInfo = describe_weights(model)
        if self.weights.kinds:
            quant_matmul.check_settings()
        logger.info("pagedserve worker: weights %s", self.weights)
        if packing_available(self.device, self.dtype):
            model.pack_for_cpu()
        model.backend = select_backend(model, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what loading freed goes back before the memory is measured
        return model.eval()

    def _default_kv_budget(self) -> int:
        if self.device.type == "cuda":
            return self._profile_kv_budget()
        return min(DEFAULT_CPU_KV_MAX_BYTES, int(available_ram_bytes() * DEFAULT_CPU_KV_FRACTION))

    def _profile_kv_budget(self) -> int:
        """CUDA: the KV budget left by a profiling run (:mod:`pagedserve.worker.memory_profile`)."""
        from pagedserve.worker.memory_profile import CudaMemory, profile_kv_budget, profile_run

        cfg = self.config
        num_tokens = cfg.token_budget_for(cfg.max_model_len or self.max_positions)
        num_seqs = cfg.max_num_seqs_for(self.device.type)

        def run() -> int:
            return profile_run(self.model, num_tokens, num_seqs, cfg.block_size, self.dtype, cfg.kv_cache_dtype, self.device)

        return profile_kv_budget(run, CudaMemory(self.device), cfg.gpu_memory_utilization).kv_budget

    def _size_kv_cache(self) -> KVCacheSpec:
        cfg = self.config
        B = cfg.block_size
        block_bytes = kv_cache_bytes_per_block(self.hf_config, B, self.dtype, cfg.kv_cache_dtype)  # all KV heads (every rank's share)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            budget = cfg.kv_cache_memory_bytes or self._default_kv_budget()
            if self.tp is not None and self.device.type == "cuda":
                budget *= self.tp.world_size  # a GPU's budget holds its rank's 1/N of each block
            num_blocks = budget // block_bytes
            if cfg.kv_cache_memory_bytes is None:
                # A default budget never needs more than every sequence at full length.
                max_len = cfg.max_model_len or self.max_positions
                num_blocks = min(num_blocks, cfg.max_num_seqs_for(self.device.type) * -(-max_len // B))
            if num_blocks < 1:
                raise ValueError(f"KV cache budget of {budget} bytes is smaller than one block ({block_bytes} bytes)")
        return self.kv_spec_for(num_blocks, block_bytes)

    def kv_spec_for(self, num_blocks: int, block_bytes: Optional[int] = None) -> KVCacheSpec:
        """The spec of a pool of ``num_blocks`` blocks (a tensor-parallel executor lowers rank
        0's to the smallest any rank can hold). Raises ValueError when a request of
        max_model_len tokens cannot run alone in the pool (:func:`blocks_held_alone`)."""
        cfg = self.config
        B = cfg.block_size
        if block_bytes is None:
            block_bytes = self.kv_spec.block_bytes
        capacity = num_blocks * B
        window = sliding_window(self.hf_config)

        def held(max_len: int) -> int:  # the most blocks one request holds at once
            return blocks_held_alone(max_len, B, window, cfg.token_budget_for(max_len) if cfg.enable_chunked_prefill else None)

        if cfg.max_model_len is None:
            max_model_len = self.max_positions if held(self.max_positions) <= num_blocks else min(self.max_positions, capacity)
        elif held(cfg.max_model_len) > num_blocks:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} tokens does not fit in the KV cache ({num_blocks} blocks "
                f"x {B} = {capacity} tokens; one request holds up to {held(cfg.max_model_len)} blocks); "
                "raise kv_cache_memory_bytes/num_kv_blocks or lower max_model_len"
            )
        else:
            max_model_len = cfg.max_model_len
        return KVCacheSpec(num_blocks, block_bytes, max_model_len, window)

    def initialize_cache(self, config: EngineConfig, num_blocks: Optional[int] = None) -> None:
        """Allocate the KV pool of ``num_blocks`` (default ``kv_spec.num_blocks``) blocks and the
        input batch for the resolved ``config`` (its max_num_seqs and max_model_len; on CUDA
        its token budget sizes the step buffers, and ``enforce_eager=False`` captures the
        decode graphs here)."""
        if num_blocks is not None:
            self.kv_spec.num_blocks = num_blocks
        self.model_runner = ModelRunner(
            self.model,
            self.kv_spec.num_blocks,
            config.block_size,
            self.device,
            self.dtype,
            config.max_num_seqs,
            config.max_model_len,
            config.kv_cache_dtype,
            pooling_type=config.pooler.pooling_type if config.pooler is not None else None,
            lora_manager=self.lora_manager,
            max_num_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
        )
        if config.kv_transfer_config is not None:
            from pagedserve.core.kv_cache_manager import hash_seed
            from pagedserve.distributed.kv_transfer.wire import kv_layout
            from pagedserve.distributed.kv_transfer.worker_side import NetworkConnectorWorker

            kv = self.model_runner.kv_cache
            attn = self.model.layers[0].self_attn
            layout = kv_layout(
                self.model_identity.split("|")[0],
                str(kv.dtype).replace("torch.", ""),
                config.block_size,
                kv.shape[0],
                kv.shape[3],
                attn.head_dim,
                hash_seed(self.model_identity),
                self.weights.kind,
            )
            self.kv_connector = NetworkConnectorWorker(config.kv_transfer, kv, layout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Tensor-parallel ranks > 0 return an empty output (rank 0 samples)."""
        connector = self.kv_connector
        if connector is None:
            return self.model_runner.execute_model(scheduler_output)
        connector.start_load_kv(scheduler_output.kv_connector_metadata, scheduler_output.finished_req_ids)
        out = self.model_runner.execute_model(scheduler_output)
        out.kv_connector_output = connector.get_finished()
        return out

    def add_lora(self, lora: LoRARequest) -> None:
        """Load and check a LoRA adapter (see :class:`LoRAManager`). Raises ValueError when
        LoRA is off or the adapter is refused."""
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        self.lora_manager.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora_manager is not None:
            # Zeroing its slot writes the slot tensors, made in a step's inference mode: in-place
            # updates of inference tensors are refused outside it (and would kill the core).
            with torch.inference_mode():
                self.lora_manager.remove(lora_int_id)

    def shutdown(self) -> None:
        """Stop the KV connector's threads and sockets (bounded time)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
