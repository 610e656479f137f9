"""The small ops of a decoder layer as one Triton kernel each on CUDA (the GPU's `FusedOps`).

In eager torch a layer's RMSNorm is ~8 kernels, residual add + RMSNorm ~9, RoPE on q|k ~7 and
SwiGLU 2: ~30 launches a layer, ~900 a step for a 30-layer model, which bounds a CUDA-graph
step at a few ms however small the model. Here each is one launch (10 a layer with the matmuls
and attention). Every kernel works row by row in fp32 with a fixed block, so a row's result
does not depend on the batch (row invariance, as the paged attention kernel). The rounding is
not the eager ops' (one rounding to the activation dtype instead of one per op); both CUDA paths,
eager and graphs, use these same kernels.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the CPU tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n, eps, stride_x, stride_d,
                HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(d_ptr + row * stride_d + i, mask=ok, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # the residual stream as stored
        tl.store(sum_ptr + row * n + i, x, mask=ok)
        x = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + i, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_c, HALF: tl.constexpr,
                 HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < HEADS) & (j[None, :] < HALF)
    base = t * stride_t + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(qkv_ptr + base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + base + HALF, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    o = t * HEADS * 2 * HALF + h[:, None] * (2 * HALF) + j[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + o, (x1 * c - x2 * s).to(ty), mask=ok)
    tl.store(out_ptr + o + HALF, (x2 * c + x1 * s).to(ty), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + i, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * n + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rms(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, n = x.shape
    out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    s = torch.empty_like(out) if delta is not None else out
    if T:
        d = delta if delta is not None else x
        _rms_kernel[(T,)](x, d, weight, s, out, n, eps, x.stride(0), d.stride(0),
                          delta is not None, triton.next_power_of_2(n))
    return s, out


class TritonFusedOps:
    """The interface of `dynaspec.models.layers.FusedOps`, one kernel per op, for CUDA."""

    ext = None  # no C++ layer stack on the GPU

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            from dynaspec.models.layers import rms_norm

            return rms_norm(x, weight, eps)
        return _rms(x, None, weight, eps)[1]

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)) in one pass."""
        return _rms(x.contiguous(), delta.contiguous(), weight, eps)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                head_dim: int) -> torch.Tensor:
        """qkv [T, >= heads*D] (rows contiguous); cos/sin [T, 1, D/2]. Returns [T, heads, D]."""
        T = qkv.shape[0]
        out = torch.empty((T, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if T:
            c, s = cos.reshape(T, -1), sin.reshape(T, -1)
            half = head_dim // 2
            _rope_kernel[(T,)](qkv, c, s, out, qkv.stride(0), c.stride(0), half, heads,
                               triton.next_power_of_2(heads), triton.next_power_of_2(half))
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        T, n2 = gate_up.shape
        n = n2 // 2
        out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
        if T:
            block = 1024
            _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                         block)
        return out


def gpu_fused_ops(device: torch.device):
    """TritonFusedOps on CUDA where Triton imports, else None (the caller keeps eager ops)."""
    if device.type != "cuda":
        return None
    return TritonFusedOps()
