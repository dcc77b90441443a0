"""Quantized weight matrices as the kernels keep them: small integers with a float32 scale (and
optionally a float32 offset, the "min") per group of consecutive inputs of an output row.

One layout covers every GGUF type pagedserve serves, repacked at load time
(:mod:`pagedserve.model.gguf_quant`), and the online int8 of ``--quantization int8``::

    W[n, k] = q[n, k] * scales[n, k // group] + mins[n, k // group]     (mins: 0 when None)

- ``bits == 8``: ``qdata`` int8 ``[N, K]``, signed (Q8_0, Q5_0 - 16, Q6_K - 32, online int8) or
  unsigned values that fit 0..127 (Q5_1, Q5_K: 0..31);
- ``bits == 4``: ``qdata`` uint8 ``[N, K // 2]``, unsigned 0..15; in each group of 32 inputs
  ``k0..k0+31`` the byte ``k0 // 2 + j`` holds input ``k0 + j`` in its low nibble and
  ``k0 + 16 + j`` in its high nibble (``j < 16``: ggml's Q4_0/Q4_1/Q4_K order within 32).
  ``group`` is then a multiple of 32.

``scales`` and ``mins`` are float32 ``[N, K // group]``. Bytes per weight: Q4 types 0.75 (0.5 +
two float32 per 32), Q8_0 1.125, Q6_K 1.25 (a scale per 16), online int8 ~1.0.

The float reference of every kernel is :meth:`QuantizedWeight.dequantize` (float32, the same
arithmetic: one product and one sum per weight, in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[N, K]`` weight (see the module docstring for the layout).

    Attributes:
        qdata: int8 ``[N, K]`` (bits 8) or uint8 ``[N, K // 2]`` (bits 4), contiguous.
        scales: float32 ``[N, K // group]``, contiguous.
        mins: float32 ``[N, K // group]`` or None (all zero).
        bits: 4 or 8.
        group: inputs per scale (a multiple of 16; of 32 for bits 4); K is a multiple of it.
        qtype: the source's type name (``"Q4_K"``, ``"Q8_0"``, ``"int8"``, ...), for logs and
            the prefix-cache key.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    bits: int
    group: int
    qtype: str

    def __post_init__(self) -> None:
        N = self.qdata.shape[0]
        K = self.in_features
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group <= 0 or self.group % (32 if self.bits == 4 else 16) or K % self.group:
            raise ValueError(f"group {self.group} does not fit bits={self.bits} and K={K}")
        want_q = torch.int8 if self.bits == 8 else torch.uint8
        if self.qdata.dtype != want_q or self.qdata.dim() != 2:
            raise ValueError(f"qdata must be a 2-D {want_q} tensor, got {self.qdata.dtype} {tuple(self.qdata.shape)}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (N, K // self.group)):
                raise ValueError(f"{name} must be float32 {(N, K // self.group)}, got {t.dtype} {tuple(t.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.qdata.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qdata.shape[1]) * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        n = self.qdata.numel() * self.qdata.element_size() + self.scales.numel() * 4
        return n + (self.mins.numel() * 4 if self.mins is not None else 0)

    def values(self) -> torch.Tensor:
        """The integer values ``q`` as int16 ``[N, K]`` (nibbles unpacked)."""
        if self.bits == 8:
            return self.qdata.to(torch.int16)
        N, K = self.shape
        b = self.qdata.view(N, K // 32, 16).to(torch.int16)
        return torch.cat((b & 0xF, b >> 4), dim=2).reshape(N, K)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[N, K]``: ``q * scale + min`` in float32, then cast to ``dtype``."""
        N, K = self.shape
        q = self.values().to(torch.float32).view(N, K // self.group, self.group)
        w = q * self.scales[:, :, None]
        if self.mins is not None:
            w = w + self.mins[:, :, None]
        return w.reshape(N, K).to(dtype)

    # -- reshaping (loading, fusing, tensor parallelism) ----------------------------------------
    def widened(self, group: int) -> "QuantizedWeight":
        """The same weight as int8 values (bits 8) with ``group`` inputs per scale (``group``
        divides this one's); exact."""
        if group == self.group and self.bits == 8:
            return self
        if self.group % group:
            raise ValueError(f"group {group} does not divide {self.group}")
        r = self.group // group
        q = self.values().to(torch.int8) if self.bits == 4 else self.qdata
        scales = self.scales.repeat_interleave(r, dim=1).contiguous()
        mins = None if self.mins is None else self.mins.repeat_interleave(r, dim=1).contiguous()
        return QuantizedWeight(q.contiguous(), scales, mins, 8, group, self.qtype)

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Output rows ``start:end`` (a copy)."""
        mins = None if self.mins is None else self.mins[start:end].contiguous()
        return replace(self, qdata=self.qdata[start:end].contiguous(), scales=self.scales[start:end].contiguous(), mins=mins)

    def cols(self, start: int, end: int) -> "QuantizedWeight":
        """Inputs ``start:end`` (a copy). Raises ValueError unless both are multiples of ``group``."""
        if start % self.group or end % self.group:
            raise ValueError(f"inputs {start}:{end} cut a quantization group of {self.group}")
        g0, g1 = start // self.group, end // self.group
        div = 2 if self.bits == 4 else 1
        mins = None if self.mins is None else self.mins[:, g0:g1].contiguous()
        return replace(self, qdata=self.qdata[:, start // div : end // div].contiguous(), scales=self.scales[:, g0:g1].contiguous(), mins=mins)

    def padded_rows(self, n: int) -> "QuantizedWeight":
        """``n >= N`` rows, the new ones all zero (weights of value 0)."""
        N = self.out_features
        if n == N:
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
            out[:N] = t
            return out

        return replace(self, qdata=pad(self.qdata), scales=pad(self.scales), mins=None if self.mins is None else pad(self.mins))

    def permuted_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """Rows in the order ``index`` (int64 ``[N]``)."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return replace(self, qdata=self.qdata[index].contiguous(), scales=self.scales[index].contiguous(), mins=mins)


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The row-wise concatenation (fused q/k/v, gate/up), exact: parts of different layouts are
    widened to int8 with the greatest common group, and given zero mins where one has mins.

    Raises:
        ValueError: parts with different numbers of inputs.
    """
    if len({p.in_features for p in parts}) != 1:
        raise ValueError(f"cannot fuse weights with inputs {[p.in_features for p in parts]}")
    qtypes = sorted({p.qtype for p in parts})
    qtype = qtypes[0] if len(qtypes) == 1 else "+".join(qtypes)
    same = len({(p.bits, p.group) for p in parts}) == 1
    if not same:
        group = math.gcd(*(p.group for p in parts))  # a multiple of 16: every group is
        parts = [p.widened(group) for p in parts]
    any_mins = any(p.mins is not None for p in parts)
    mins = None
    if any_mins:
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts]).contiguous()
    p0 = parts[0]
    return QuantizedWeight(
        torch.cat([p.qdata for p in parts]).contiguous(), torch.cat([p.scales for p in parts]).contiguous(), mins, p0.bits, p0.group, qtype
    )


def quantize_int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel (``--quantization int8``): ``scale = max|w_row| / 127``,
    ``q = round(w / scale)``; one group per row. ``weight``: ``[N, K]`` float, K a multiple of 16.

    Raises:
        ValueError: K not a multiple of 16.
    """
    w = weight.detach().to(torch.float32)
    N, K = w.shape
    if K % 16:
        raise ValueError(f"int8 quantization needs inputs in multiples of 16, got {K}")
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scales), -127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scales.contiguous(), None, 8, K, "int8")
