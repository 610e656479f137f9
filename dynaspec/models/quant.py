"""Weight-only quantized tensors: GGUF Q4_0/Q4_1/Q8_0 blocks kept as they are, or HF weights quantized.

A QuantizedTensor is the loader's form of a 2-D weight [N out, K in] whose values are small
integers times per-group scales; it crosses the loader -> model boundary in the state dict in
place of a float tensor. The model turns it into a kernel (models/quant_linear.py) or, in
reference mode, back into floats. Conventions are torch's int4pack ones so nothing is re-derived
at pack time:

- "q4": w = scale * (q - 8) + zero, q in 0..15, one scale/zero per group of `group_size` along K.
  GGUF Q4_1 (w = d*q + m) maps exactly: scale = d, zero = m + 8d; Q4_0 (w = d*(q-8)): zero = 0.
- "q8": w = scale * q, q in -128..127, one scale per group along K (GGUF Q8_0: group 32), or per
  output channel when group_size == K (what torch's int8 kernel takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GGUF_GROUP = 32  # every GGUF block type kept here holds 32 weights


@dataclass
class QuantizedTensor:
    kind: str  # "q4" | "q8"
    q: torch.Tensor  # [N, K] uint8 (q4: 0..15) or int8 (q8)
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor | None  # [N, K // group_size] float32 for q4; None for q8
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the exact values the integers and scales stand for."""
        g = self.group_size
        s = self.scale.repeat_interleave(g, dim=1)
        if self.kind == "q8":
            return self.q.float() * s
        return (self.q.float() - 8.0) * s + self.zero.repeat_interleave(g, dim=1)

    def rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The tensor with its output rows reordered (e.g. undoing llama.cpp's q/k permutation)."""
        z = None if self.zero is None else self.zero[index]
        return QuantizedTensor(self.kind, self.q[index], self.scale[index], z, self.group_size)

    def nbytes_packed(self) -> int:
        """Bytes one matmul streams in the kernel's format (4 or 8 bits + bf16 scales/zeros)."""
        n, k = self.q.shape
        groups = k // self.group_size
        if self.kind == "q4":
            return n * k // 2 + n * groups * 2 * 2
        return n * k + n * groups * 2


def cat_rows(parts: list) -> "QuantizedTensor | torch.Tensor":
    """Stack weights along the output axis (q|k|v, gate|up). Mixed kinds fall back to float32."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        first = parts[0]
        if all(p.kind == first.kind and p.group_size == first.group_size for p in parts):
            zero = None if first.zero is None else torch.cat([p.zero for p in parts])
            return QuantizedTensor(first.kind, torch.cat([p.q for p in parts]),
                                   torch.cat([p.scale for p in parts]), zero, first.group_size)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float() for p in parts])


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """raw: uint8 [N, K/32 * block_bytes], GGUF's rows of blocks; type_name Q4_0 | Q4_1 | Q8_0."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n, k // GGUF_GROUP, -1)  # [N, groups, block_bytes]
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, groups]
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantizedTensor("q8", torch.from_numpy(q), torch.from_numpy(d), None, GGUF_GROUP)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
        zero = m + 8.0 * d
    elif type_name == "Q4_0":
        packed = blocks[..., 2:]
        zero = np.zeros_like(d)
    else:
        raise ValueError(f"GGUF type {type_name} is not kept quantized (only Q4_0, Q4_1, Q8_0)")
    # Each block's 16 bytes hold element j in the low nibble and element j+16 in the high one.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k)  # [N, K] 0..15
    return QuantizedTensor("q4", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero),
                           GGUF_GROUP)


def quantize_int4(w: torch.Tensor, group_size: int = GGUF_GROUP) -> QuantizedTensor:
    """Asymmetric min/max int4 per group of `group_size` along K; w: float [N, K]."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 quantization needs in_features divisible by {group_size}, got {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, groups]
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # a constant group gets q = 0 and zero = its value
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedTensor("q4", q, scale, lo + 8.0 * scale, group_size)


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 with one scale per output channel (torch's _weight_int8pack_mm layout)."""
    n, k = w.shape
    w = w.float()
    scale = (w.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-12)  # [N, 1]
    q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("q8", q, scale, None, k)


def to_per_channel_int8(t: QuantizedTensor | torch.Tensor) -> QuantizedTensor:
    """Any weight as per-channel int8: kept as is when it already is, else requantized."""
    if isinstance(t, QuantizedTensor) and t.kind == "q8" and t.group_size == t.shape[1]:
        return t
    return quantize_int8(t.dequantize() if isinstance(t, QuantizedTensor) else t)
