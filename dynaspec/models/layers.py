"""Building blocks of a Llama-family decoder: RMSNorm and RoPE (plain and llama3-scaled)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class SmallOps(Protocol):
    """A decoder layer's small ops: `FusedOps` (C++ on the CPU, or eager) or
    `dynaspec.models.gpu_ops.TritonFusedOps` (CUDA)."""

    ext: Any  # the C++ extension with its LayerStack, or None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                head_dim: int) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class FusedOps:
    """RMSNorm, residual add + RMSNorm and SwiGLU as one C++ call each on the CPU (dynaspec/csrc/
    fused_ops.cpp, same rounding as the eager code), RoPE on q|k in place, or the eager ops where
    the kernels are not built. A batch-1 step ran ~2,500 small ops; each fused call replaces 3-8."""

    def __init__(self, enabled: bool) -> None:
        self.ext: Any = None
        if enabled:
            from dynaspec import cpu_kernels

            self.ext = cpu_kernels.extension() if cpu_kernels.available()[0] else None

    # Under torch.compile the eager forms are traced and fused by inductor: a pybind call would
    # break the graph (the compiled path then falls back to eager).
    def _kernels(self) -> Any:
        """The extension, or None where the eager forms run."""
        return None if self.ext is None or torch.compiler.is_compiling() else self.ext

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ext = self._kernels()
        if ext is None or not x.is_contiguous():
            return rms_norm(x, weight, eps)
        return ext.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)); x is updated in place on the fused path."""
        ext = self._kernels()
        if ext is None or not (x.is_contiguous() and delta.is_contiguous()):
            x = x + delta
            return x, rms_norm(x, weight, eps)
        return x, ext.add_rms_norm(x, delta, weight, eps)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                head_dim: int) -> torch.Tensor:
        """RoPE on the first `heads` heads (q|k) of each row of qkv [T, >= heads*D]; cos/sin
        [T, 1, D/2]. Returns q|k rotated as [T, heads, D] (a view of qkv on the fused path)."""
        T = qkv.shape[0]
        qk = qkv[:, : heads * head_dim]
        ext = self._kernels()
        if ext is None or qkv.stride(1) != 1:
            return apply_rope(qk.reshape(T, heads, head_dim), cos, sin)
        ext.rope_inplace(qkv, cos.reshape(T, -1), sin.reshape(T, -1), heads, head_dim)
        return qk.view(T, heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        ext = self._kernels()
        if ext is None or not gate_up.is_contiguous():
            return silu_and_mul(gate_up)
        return ext.silu_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Upcast like HF's LlamaRMSNorm so fp32 parity holds and bf16 keeps its accuracy.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":  # positions divided by the factor (Gemma-3's global layers)
        return (inv_freq / scaling["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


class RotaryCache:
    """cos/sin tables for every position, computed once; indexed once per step for all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_pos: int,
                 device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [head_dim/2]
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim/2]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim/2] each, broadcast over heads
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] in HF's rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, inter] each
    return F.silu(gate) * up


@torch.library.custom_op("dynaspec::mkldnn_linear", mutates_args=())
def _mkldnn_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_mkldnn_linear_op.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _mkldnn_linear_ok(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def keep(module: torch.nn.Module, name: str, t: torch.Tensor | None) -> None:
    """Register a weight on a module: float tensors as frozen parameters (inference only),
    packed integer or opaque kernel layouts as buffers, None as an empty buffer slot. The
    tensor object is kept as it is (no copy), so the kernels read exactly what they read before."""
    if t is not None and t.is_floating_point() and t.layout == torch.strided:
        module.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    else:
        module.register_buffer(name, t, persistent=t is not None)


class KernelModule(torch.nn.Module):
    """A leaf kernel (matmul, lookup) as a module: its weights are parameters/buffers (so
    `.parameters()`, `state_dict()` and counting work) but a call goes straight to `forward`.
    Leaf kernels run ~120 times per step on the Python layer loop and Module.__call__'s hook
    dispatch costs ~1.5 us each (measured here); hooks are served at the layer and model level."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(KernelModule):
    """y = x W^T + b. On the CPU in bf16 the weight is prepacked for oneDNN once at load time:
    measured here, 2-3x faster than aten's bf16 GEMV at decode sizes, with bit-identical output."""

    # Registered by keep(): exactly one of packed (the oneDNN layout) and weight is set.
    bias: torch.Tensor | None
    packed: torch.Tensor | None
    weight: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = None
        if _mkldnn_linear_ok(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except RuntimeError:
                packed = None
        keep(self, "bias", bias)
        keep(self, "packed", packed)
        keep(self, "weight", None if packed is not None else weight)

    @property
    def nbytes(self) -> int:
        """Bytes of weight one matmul streams."""
        w = self.packed if self.packed is not None else self.weight
        assert w is not None
        return self.out_features * self.in_features * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if torch.compiler.is_compiling():
                # Inductor lowers the raw op only for frozen constant weights; as an opaque op
                # it stays the same oneDNN call and the code around it is still fused.
                return _mkldnn_linear_op(x, self.packed, self.bias, self.out_features)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
