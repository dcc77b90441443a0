"""Projections and the token embedding over quantized weights
(:class:`pagedserve.ops.quantized.QuantizedWeight`), and the model surgery that puts them in
place of ``nn.Linear`` / ``nn.Embedding`` before the weights are loaded.

The quantized weight is a plain attribute, not a parameter or buffer: ``model.to(dtype)`` casts
the activations' parameters (biases, norms) and leaves the integer values and their float32
scales as they are. On the CPU the products run on ``pagedserve.ops.cpu.quant_matmul``; on
other devices the weights are dequantized in memory at load time instead (the worker does it),
so these modules only ever run on the CPU.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedserve.ops.cpu.quant_matmul import quant_matmul
from pagedserve.ops.quantized import QuantizedWeight


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` with a quantized ``W [out_features, in_features]``.

    ``x [M, in_features]`` float32 or bfloat16 -> ``[M, out_features]`` in x's dtype.
    The weight is set by :meth:`set_weight` (the loader); until then forward raises.
    """

    def __init__(self, in_features: int, out_features: int, bias: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.qweight: Optional[QuantizedWeight] = None

    def set_weight(self, qweight: QuantizedWeight) -> None:
        """Raises ValueError when the shape is not ``[out_features, in_features]``."""
        if qweight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight has shape {qweight.shape}, expected {(self.out_features, self.in_features)}")
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            raise RuntimeError("QuantLinear used before its weight was loaded")
        return quant_matmul(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        q = self.qweight
        kind = f"{q.qtype}, {q.bits}-bit, group {q.group}" if q is not None else "not loaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class QuantEmbedding(nn.Module):
    """Token embedding over a quantized ``[vocab, hidden]`` table: the rows of a step's tokens
    are dequantized on lookup. ``ids [T]`` int64 -> ``[T, hidden]`` in ``dtype``, the
    activations' dtype (a plain attribute the loader sets: ``model.to`` leaves it alone)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.qweight: Optional[QuantizedWeight] = None
        self.dtype = torch.float32

    def set_weight(self, qweight: QuantizedWeight) -> None:
        if qweight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embedding has shape {qweight.shape}, expected {(self.num_embeddings, self.embedding_dim)}")
        self.qweight = qweight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            raise RuntimeError("QuantEmbedding used before its weight was loaded")
        return self.qweight.permuted_rows(ids.reshape(-1)).dequantize(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        q = self.qweight
        return f"{self.num_embeddings}, {self.embedding_dim}, {q.qtype if q is not None else 'not loaded'}"


def quantize_modules(model: nn.Module, names: Iterable[str]) -> None:
    """Replace the ``nn.Linear`` / ``nn.Embedding`` submodules of ``model`` named in ``names``
    (module paths such as ``layers.0.self_attn.qkv_proj``) by their quantized twins, keeping a
    linear's bias parameter. Call it on the meta device, before the weights are allocated.

    Raises:
        ValueError: a name that is not a Linear or Embedding of the model.
    """
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = getattr(parent, leaf, None)
        if isinstance(child, nn.Linear):
            setattr(parent, leaf, QuantLinear(child.in_features, child.out_features, child.bias))
        elif isinstance(child, nn.Embedding):
            setattr(parent, leaf, QuantEmbedding(child.num_embeddings, child.embedding_dim))
        else:
            raise ValueError(f"{name!r} is not a linear layer or embedding of the model")


def quantized_weight_bytes(model: nn.Module) -> tuple[int, dict[str, int]]:
    """Bytes of the model's quantized weights (each counted once), and the count of quantized
    matrices per type name (``{"Q4_1": 210, "Q8_0": 1}``)."""
    seen: set[int] = set()
    total = 0
    kinds: dict[str, int] = {}
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if isinstance(q, QuantizedWeight) and id(q) not in seen:
            seen.add(id(q))
            total += q.nbytes
            kinds[q.qtype] = kinds.get(q.qtype, 0) + 1
    return total, kinds
