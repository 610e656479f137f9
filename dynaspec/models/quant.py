"""Weight-only quantized tensors: GGUF blocks (Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and the K-quants Q4_K/Q5_K/
Q6_K) kept as small integers with float scales, or HF weights quantized.

A QuantizedTensor is the loader's form of a 2-D weight [N out, K in] whose values are small
integers times per-group scales; it crosses the loader -> model boundary in the state dict in
place of a float tensor. The model turns it into a kernel (models/quant_linear.py) or, in
reference mode, back into floats. Conventions are torch's int4pack ones so nothing is re-derived
at pack time:

- "q4": w = scale * (q - 8) + zero, q in 0..15, one scale/zero per group of `group_size` along K.
  GGUF Q4_1 (w = d*q + m) maps exactly: scale = d, zero = m + 8d; Q4_0 (w = d*(q-8)): zero = 0.
- "q8": w = scale * q + zero, q in -128..127, one scale (and optional zero) per group along K
  (GGUF Q8_0: group 32), or per output channel when group_size == K (what torch's int8 kernel
  takes). zero None means 0.

Every GGUF type below maps exactly (float32 products of an fp16 scale and a 6/8-bit sub-scale):
Q4_K -> q4/32 (zero = 8*d*sc - dmin*m); Q5_0 -> q8/32 (q-16, no zero); Q5_1, Q5_K -> q8/32
with zero (5-bit q fits int8); Q6_K -> q8/16 (q-32, no zero). Unpacking is whole-tensor numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GGUF_GROUP = 32  # Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks and K-quant sub-blocks hold 32 weights
QK_K = 256  # a K-quant super-block
# Bytes per block of each GGUF type kept quantized, and how many weights a block holds.
GGUF_BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q5_0": (22, 32),
               "Q5_1": (24, 32), "Q4_K": (144, QK_K), "Q5_K": (176, QK_K), "Q6_K": (210, QK_K)}
KEPT_QUANTIZED = tuple(GGUF_BLOCKS)


@dataclass
class QuantizedTensor:
    kind: str  # "q4" | "q8"
    q: torch.Tensor  # [N, K] uint8 (q4: 0..15) or int8 (q8)
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor | None  # [N, K // group_size] float32; always for q4, optional for q8
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the exact values the integers and scales stand for."""
        g = self.group_size
        s = self.scale.repeat_interleave(g, dim=1)
        if self.kind == "q8":
            w = self.q.float() * s
            return w if self.zero is None else w + self.zero.repeat_interleave(g, dim=1)
        assert self.zero is not None  # q4 always has its minimum terms
        return (self.q.float() - 8.0) * s + self.zero.repeat_interleave(g, dim=1)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The tensor with its output rows reordered (e.g. undoing llama.cpp's q/k permutation)."""
        z = None if self.zero is None else self.zero[index]
        return QuantizedTensor(self.kind, self.q[index], self.scale[index], z, self.group_size)

    def nbytes_packed(self) -> int:
        """Bytes one matmul streams in the kernel's format (4 or 8 bits + bf16 scales/zeros)."""
        n, k = self.q.shape
        groups = k // self.group_size
        if self.kind == "q4":
            return n * k // 2 + n * groups * 2 * 2
        return n * k + n * groups * 2 * (1 if self.zero is None else 2)

    def as_q8(self, group_size: int | None = None) -> QuantizedTensor:
        """The same values as q8 (q4's q-8 fits int8), optionally with smaller groups (the
        scales repeated): what lets q4 and q8 weights share one fused matrix exactly."""
        g = group_size or self.group_size
        if self.group_size % g:
            raise ValueError(f"cannot regroup {self.group_size} into groups of {g}")
        r = self.group_size // g
        q = self.q if self.kind == "q8" else (self.q.to(torch.int16) - 8).to(torch.int8)
        z = None if self.zero is None else self.zero.repeat_interleave(r, dim=1)
        return QuantizedTensor("q8", q, self.scale.repeat_interleave(r, dim=1), z, g)


def cat_rows(parts: list) -> QuantizedTensor | torch.Tensor:
    """Stack weights along the output axis (q|k|v, gate|up). Q4_K_M files mix types inside one
    fused matrix (q|k Q4_K, v Q6_K): mixed kinds become q8 in the smallest group (exact); float
    parts make the whole matrix float32."""
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        return torch.cat(
            [p.dequantize() if isinstance(p, QuantizedTensor) else p.float() for p in parts]
        )
    g = min(p.group_size for p in parts)
    groups = {p.group_size for p in parts}
    if len(groups) > 1 and (max(groups) > GGUF_GROUP or any(x % g for x in groups)):
        # e.g. per-channel int8 beside int4: regrouping would not keep either kernel's form
        return torch.cat([p.dequantize() for p in parts])
    if any(p.kind != parts[0].kind or p.group_size != g for p in parts):
        parts = [p.as_q8(g) for p in parts]
    first = parts[0]
    zero = None
    if any(p.zero is not None for p in parts):  # a q8 part without zero gets explicit zeros
        zero = torch.cat([torch.zeros_like(p.scale) if p.zero is None else p.zero for p in parts])
    return QuantizedTensor(first.kind, torch.cat([p.q for p in parts]),
                           torch.cat([p.scale for p in parts]), zero, g)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """raw: uint8, GGUF's rows of blocks ([N, K / block_weights * block_bytes]); shape [N, K]."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(
            f"GGUF type {type_name} is not kept quantized (only {', '.join(KEPT_QUANTIZED)})"
        )
    n, k = shape
    nbytes, per_block = GGUF_BLOCKS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(n, k // per_block, nbytes)  # [N, blocks, bytes]
    kind, q, scale, zero, group = _UNPACK[type_name](blocks)
    def as_t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    return QuantizedTensor(kind, as_t(q), as_t(scale.astype(np.float32)),
                           None if zero is None else as_t(zero), group)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry along the last axis -> float32 (the fp16 d/dmin fields)."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    # Q4_0/Q4_1/Q5_x: a block's 16 bytes hold element j (low nibble) and j+16 (high nibble).
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes = a little-endian uint32 whose bit j is element j's fifth bit."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]
    return bits << 4


def _q8_0(b):
    return "q8", b[..., 2:].copy().view(np.int8), _f16(b[..., :2]), None, 32


def _q4_0(b):
    d = _f16(b[..., :2])
    return "q4", _nibbles(b[..., 2:]), d, np.zeros_like(d), 32


def _q4_1(b):
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    return "q4", _nibbles(b[..., 4:]), d, m + 8.0 * d, 32


def _q5_0(b):
    q = (_nibbles(b[..., 6:]) | _high_bits(b[..., 2:6])).astype(np.int8) - 16  # -16..15
    return "q8", q, _f16(b[..., :2]), None, 32


def _q5_1(b):
    q = (_nibbles(b[..., 8:]) | _high_bits(b[..., 4:8])).astype(np.int8)  # 0..31
    return "q8", q, _f16(b[..., :2]), _f16(b[..., 2:4]), 32


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (ggml get_scale_min_k4)."""
    lo, hi = sc[..., :4], sc[..., 4:8]
    scales = np.concatenate([lo & 63, (sc[..., 8:] & 0xF) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (sc[..., 8:] >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)  # [..., 8] each


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: chunk c of 32 bytes gives sub-block 2c (low) and 2c+1 (high)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _k_scales(b[..., 4:16])
    scale, minimum = d * sc, dmin * m  # [N, blocks, 8] exact in float32
    return "q4", _k_low_nibbles(b[..., 16:]), scale, 8.0 * scale - minimum, 32


def _q5_k(b):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _k_scales(b[..., 4:16])
    # qh byte l holds bit s for element l of sub-block s.
    bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # [N, blocks, 32, 8]
    high = np.moveaxis(bits, -1, -2).reshape(*b.shape[:-1], QK_K) << 4
    q = (_k_low_nibbles(b[..., 48:]) | high).astype(np.int8)  # 0..31
    return "q8", q, d * sc, -(dmin * m), 32


def _q6_k(b):
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, blocks, 16]
    d = _f16(b[..., 208:210])[..., None]
    out = []
    for half in range(2):  # two 128-weight halves, each from 64 ql bytes and 32 qh bytes
        lo, h = ql[..., 64 * half: 64 * half + 64], qh[..., 32 * half: 32 * half + 32]
        for j, nib in enumerate(
            (lo[..., :32] & 0xF, lo[..., 32:] & 0xF, lo[..., :32] >> 4, lo[..., 32:] >> 4)
        ):
            out.append(nib | (((h >> (2 * j)) & 3) << 4))
    q = (np.concatenate(out, axis=-1).astype(np.int8) - 32)  # [N, blocks, 256] in -32..31
    return "q8", q, d * sc, None, 16


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


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
