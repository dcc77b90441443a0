"""What the loaded weights are: quantized modules put in place at load time (GGUF tensors kept
as they are, ``--quantization int8``), and the description the start-up log, ``/metrics`` and
the prefix-cache key use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from pagedserve.model.quant_linear import QuantLinear, quantized_weight_bytes
from pagedserve.ops.quantized import QuantizedWeight, quantize_int8_per_channel


def dequantize_unlisted(
    weights: Iterable[tuple[str, object]], quant_modules: set[str], module_of: Callable[[str], str]
) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors, a quantized one dequantized to float32 unless its module is in
    ``quant_modules`` (module paths: ``module_of(name)``, the model class's ``module_of``)."""
    for name, w in weights:
        if isinstance(w, QuantizedWeight) and module_of(name) not in quant_modules:
            w = w.dequantize(torch.float32)
        yield name, w


def quantize_int8(model: Any) -> int:
    """``--quantization int8``: every float projection of the decoder layers becomes symmetric
    int8 per output channel (:func:`~pagedserve.ops.quantized.quantize_int8_per_channel`),
    bias kept; the embedding and the LM head stay float. Returns how many were quantized.

    Raises:
        ValueError: a projection whose input width is not a multiple of 16.
    """
    count = 0
    for path, module in list(model.layers.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                if child.in_features % 16:
                    where = ".".join(p for p in ("layers", path, name) if p)
                    raise ValueError(
                        f"--quantization int8: {where} has {child.in_features} inputs, not a multiple of 16 (the int8 kernels' step); "
                        "serve this model unquantized"
                    )
                q = QuantLinear(child.in_features, child.out_features, child.bias)
                q.set_weight(quantize_int8_per_channel(child.weight.data))
                setattr(module, name, q)
                count += 1
    return count


@dataclass(frozen=True)
class WeightsInfo:
    """Bytes of a loaded model's weights by kind.

    Attributes:
        quantized_bytes: integer values and their scales (bytes).
        float_bytes: float parameters (bytes; norms, biases, float projections).
        kinds: quantized matrices per source type name, e.g. ``{"Q4_1": 210, "Q8_0": 1}``.
        dtype: the float parameters' dtype name.
    """

    quantized_bytes: int
    float_bytes: int
    kinds: dict[str, int] = field(default_factory=dict)
    dtype: str = "float32"

    @property
    def kind(self) -> str:
        """``"bfloat16"`` for float weights, else e.g. ``"Q4_1+Q8_0"``: part of the model
        identity (prefix-cache seed, KV-transfer handshake)."""
        return "+".join(sorted(self.kinds)) if self.kinds else self.dtype

    def __str__(self) -> str:
        mib = 1 << 20
        if not self.kinds:
            return f"{self.dtype}, {self.float_bytes / mib:.1f} MiB"
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(self.kinds.items()))
        return f"quantized ({kinds} matrices), {self.quantized_bytes / mib:.1f} MiB + {self.float_bytes / mib:.1f} MiB of {self.dtype}"


def describe_weights(model: nn.Module) -> WeightsInfo:
    """The :class:`WeightsInfo` of a loaded model (before packing for the CPU)."""
    qbytes, kinds = quantized_weight_bytes(model)
    params = list(model.parameters())
    fbytes = sum(p.numel() * p.element_size() for p in params)
    dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"
    return WeightsInfo(qbytes, fbytes, kinds, dtype)
