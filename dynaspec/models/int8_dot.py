"""The engine's CPU linear path: int8 dot products on GGUF-grouped weights, flat in width,
row-invariant.

torch's int4 kernel does fp32 multiply-adds per row in blocks of 4 rows and re-dequantizes every
weight for each further block, so a 5-token verify cost 2-2.4x a 1-token step and speculation
could not pay. Here (dynaspec/csrc/int8_gemm.cpp) activations are quantized once per call to
int8 in blocks of 32 and every row is an int8 dot product against the weights' own 4- or 8-bit
groups (VNNI where the CPU has it), each weight read once for all rows. A row's result is the
same fixed sequence of operations whatever the number of rows, so decode, verification, batching
and prefill chunks give every request the same tokens (greedy with and without speculation is
token-exact on this path).

Weights map as w = d * u + mn per group, u unsigned: Q4_0/Q4_1/Q4_K (kind "q4", u = q in 0..15,
mn = zero - 8 d) exactly; 8-bit kinds (Q8_0, Q6_K, Q5_x: u = q + 128, the offset removed in
int32) exactly, with their zero as the minimum term.
"""

from __future__ import annotations

import logging
from typing import TypeGuard

import torch

from dynaspec import cpu_features, cpu_kernels
from dynaspec.models.layers import KernelModule, keep
from dynaspec.models.quant import QuantizedTensor

log = logging.getLogger("dynaspec")
TILE = 16  # output columns per packed tile (the kernel's int32 lanes)
ISA_NAMES = ("scalar", "avx2", "avx_vnni", "avx512_vnni")


def _ext():
    ok, _ = cpu_kernels.available()
    return cpu_kernels.extension() if ok else None


def supports(w: QuantizedTensor) -> bool:
    """Whether the kernel takes this weight as it is (shape and group fit, kernels built)."""
    n, k = w.shape
    return (w.group_size in (16, 32) and n % TILE == 0 and k % 32 == 0 and w.kind in ("q4", "q8")
            and _ext() is not None)


def forced_isa(path: str) -> int:
    """The kernel's index of a path this CPU can run; PathUnavailable naming the missing flags
    otherwise (the kernel would refuse it too, but here the error names them before any call)."""
    cpu_features.require("int8_gemm", path, cpu_kernels.selection().flags)
    return ISA_NAMES.index(path)


def runnable_paths() -> list[str]:
    """The int8_gemm paths this CPU can run, preferred first."""
    return [p.name for p in cpu_features.runnable("int8_gemm", cpu_kernels.selection().flags)]


def kernel_isa() -> str:
    ext = _ext()
    return "unavailable" if ext is None else ISA_NAMES[ext.int8_gemm_isa()]


def quantize_grouped_int8(w: torch.Tensor, group_size: int = 32) -> QuantizedTensor:
    """Symmetric int8 with one scale per group of 32 along K (Q8_0's form), for float weights
    under --quantization int8/int4 on this kernel: finer than per-channel scales, same speed."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scale = (g.abs().amax(-1) / 127.0).clamp(min=1e-12)  # [N, groups]
    q = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedTensor("q8", q, scale, None, group_size)


def _fp16_exact(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.equal(t.float().half().float(), t.float()))


def pack(w: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(packed uint8 weights, scales [N/16, K/G, 16], minimum terms or None, bits); see the
    layout in int8_gemm.cpp. Scales and minima are fp16 where every one is exactly an fp16
    (GGUF's Q4_0/Q4_1/Q8_0 store them so; the K-quants' products are not): at 4 bits fp32 ones
    were a third of the bytes each decode step streams. The kernel widens them exactly."""
    n, k = w.shape
    g = w.group_size
    steps = g // 4
    mn: torch.Tensor | None
    if w.kind == "q4":
        u, bits = w.q.to(torch.uint8), 4
        # zero - 8 * scale in float64: Q4_1's zero was m + 8d in float32, so this recovers m.
        assert w.zero is not None  # q4 always has its minimum terms
        mn = (w.zero.double() - 8.0 * w.scale.double()).float()
    else:
        u, bits = (w.q.to(torch.int16) + 128).to(torch.uint8), 8
        mn = None if w.zero is None else w.zero.float()
    u = u.reshape(n // TILE, TILE, k // g, steps, 4).permute(
        0, 2, 3, 1, 4
    )  # [N/16, K/G, steps, 16, 4]
    u = u.reshape(n // TILE, k // g, steps, TILE * 4)
    if bits == 4:  # step s in the low nibbles, step s + steps/2 in the high ones
        u = u[:, :, : steps // 2] | (u[:, :, steps // 2:] << 4)
    packed = u.contiguous().reshape(-1)

    dtype = torch.float16 if _fp16_exact(w.scale) and _fp16_exact(mn) else torch.float32

    def tiles(t: torch.Tensor) -> torch.Tensor:  # [N, K/G] -> [N/16, K/G, 16]
        return t.float().reshape(n // TILE, TILE, k // g).permute(0, 2, 1).to(dtype).contiguous()

    return packed, tiles(w.scale), (None if mn is None else tiles(mn)), bits


class Int8DotLinear(KernelModule):
    """y = x W^T (+ b) through int8_gemm for any number of rows."""

    packed: torch.Tensor  # registered buffers, see __init__
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self, w: QuantizedTensor, bias: torch.Tensor | None, keep_source: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        packed, scales, mins, self.bits = pack(w)
        # Buffers, not parameters: the scales are the kernel's own tiled layout, not a weight
        # anyone trains, and a dtype cast of them would change what the kernel reads.
        self.register_buffer("packed", packed)  # uint8, see pack()
        self.register_buffer("scales", scales)  # [N/16, K/G, 16] fp16 or fp32, see pack()
        self.register_buffer("mins", mins, persistent=mins is not None)
        keep(self, "bias", bias)
        # The groups as loaded, kept only where a tied embedding looks its rows up in them.
        self.source = w if keep_source else None
        self._op = _ext().int8_gemm
        self.nbytes = self.packed.numel() + self.scales.numel() * self.scales.element_size() * (
            1 if self.mins is None else 2
        )

    def forward(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x: [M, K] bf16 or fp32 -> [M, N] in x's dtype. path: force one of ISA_NAMES ("scalar":
        the reference the tests compare with); PathUnavailable where this CPU lacks its flags."""
        isa = -1 if path is None else forced_isa(path)
        y = self._op(x.contiguous(), self.packed, self.scales, self.mins, self.out_features,
                     self.group_size, self.bits, isa)
        return y if self.bias is None else y + self.bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for W = gate's rows over up's: [M, K] -> [M, N / 2], the bits of
        FusedOps.silu_and_mul(self(x)) without storing the [M, N] product (int8_gemm_silu)."""
        if self.bias is not None:
            raise ValueError("silu_mul: a gate|up matrix with a bias is not supported")
        return _ext().int8_gemm_silu(x.contiguous(), self.packed, self.scales, self.mins,
                                     self.out_features, self.group_size, self.bits)


def activation_residual(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as fp32 [M, K], what int8_gemm's activation quantization loses of it [M, K]).

    Replays the kernel's quantization exactly (int8_quant.h quantize_rows: per `block` values,
    d = amax / 127 (0 below the smallest normal float), q = clamp(rint(v * (1 / d)), -127, 127),
    each a single fp32 rounding), so x = q * d + residual up to the rounding of that subtraction."""
    M, K = x.shape
    v = x.float().reshape(M, K // block, block)  # [M, K/32, 32]
    d = v.abs().amax(-1, keepdim=True) / 127.0  # [M, K/32, 1]
    # below the smallest normal float the kernel quantizes the block as zeros (block_scale)
    d = torch.where(d >= torch.finfo(torch.float32).tiny, d, torch.zeros_like(d))
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(v * inv).clamp_(-127.0, 127.0)  # round half to even, as nearbyint
    return v.reshape(M, K), (v - q * d).reshape(M, K)


class Int8DotHead(KernelModule):
    """The output matrix (lm_head) on the int8 kernel, with its activations in two int8 parts.

    The int8 quantization of the lm_head's input cost 0.005 top-1 against the fp32 reference
    (docs/history/benchmarks-waves-1-4.md, fifth session: 0.9551 with one part, 0.9663 with two,
    llama.cpp 0.9590). The residual of the first quantization is quantized again and both go through
    one call as 2M rows, so every weight is still read once; logits are the fp32 sum of the two
    halves. Each row's result depends on that row alone (row invariance holds).

    A row read only for its argmax (greedy, no logprobs, nothing processing its logits) skips the
    second part, which doubled the rows of the largest matrix: its tokens within `margin` of its
    one-part maximum get their logits recomputed exactly (float64 dot products with the rows of
    the table, rounded once to fp32), so its argmax is the exact matrix's wherever the one-part
    error stays under margin / 2 (its spread is ~0.05 on the default model). Still a function of
    the row alone, so greedy tokens stay the same alone, batched or speculated."""

    margin = 1.0  # logits; see above

    def __init__(self, lin: Int8DotLinear, table: object = None) -> None:
        super().__init__()
        self.lin = lin
        # Exact rows for the near-max recomputation: the tied embedding's table, else the groups
        # the linear kept; without one the kernel can read (_exact_table), rows get both parts.
        table = table if table is not None else lin.source
        self.table = table if _exact_table(table) else None
        self.out_features, self.in_features = lin.out_features, lin.in_features
        self.nbytes = lin.nbytes

    def forward(self, x: torch.Tensor, argmax_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K] -> fp32 logits [M, N]. argmax_rows: [M] bool, rows read only for their
        argmax (their other logits are the one-part values)."""
        M = x.shape[0]
        if argmax_rows is None or self.table is None or not bool(argmax_rows.any()):
            xf, rest = activation_residual(x)
            y = self.lin(torch.cat([xf, rest]))  # [2M, N]: the weights read once for both parts
            return y[:M] + y[M:]
        full = (~argmax_rows).nonzero().flatten()  # [S]: rows that need every logit
        if full.numel():
            xf, rest = activation_residual(x)
            y = self.lin(torch.cat([xf, rest[full]]))  # [M + S, N]
            logits = y[:M]
            logits[full] += y[M:]
        else:  # an all-greedy step: no residual to replay
            xf = x.float().contiguous()  # [M, K], activation_residual's first output
            logits = self.lin(xf)  # [M, N]
        t = self.table
        _ext().exact_near_max(logits, argmax_rows.nonzero().flatten(), xf, t.q, t.scale,
                              t.group_size, self.margin)
        return logits


def _exact_table(t: object) -> TypeGuard[QuantizedTensor]:
    """Whether exact_near_max can recompute rows from t: int8 values with fp32 group scales and
    no minimum (Q8_0), as loaded."""
    return (isinstance(t, QuantizedTensor) and t.kind == "q8" and t.zero is None
            and t.q.dtype == torch.int8 and t.scale.dtype == torch.float32
            and t.q.is_contiguous() and t.scale.is_contiguous())


def output_head(head: torch.nn.Module, table: object = None) -> torch.nn.Module:
    """The lm_head as the model runs it: two-part activations on the int8 kernel. table: the
    matrix's groups as loaded (a tied embedding's), for exact logits near a greedy row's max."""
    return Int8DotHead(head, table) if isinstance(head, Int8DotLinear) else head
