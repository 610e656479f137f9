"""Weight-only int4/int8 matmuls on the CPU, chosen at run time, behind the model's Linear
interface.

Decode is memory-bound, so a batch-1 step costs the bytes of weights it streams: torch's int4
kernel (`_weight_int4pack_mm_for_cpu`, group 32) reads ~0.56 bytes per weight and its int8 one
(`_weight_int8pack_mm`, per-channel scales) ~1 byte, against 2 for bf16. Both dequantize inside
the kernel for every row of x, so they lose to oneDNN's bf16 GEMM once a step has more than a
few tokens (measured here under load, all matmuls of one SmolLM2-135M step, 2 threads:
int4/bf16 = 0.4x at 1 token, ~0.8x at 4, 1.3x at 9, 2.2x at 64). A QuantLinear can therefore
keep a bf16 copy and run it for steps wider than `dense_above` tokens (memory for speed;
`dense_above=0` keeps no copy). Kernels come from the torch build's own run-time ISA dispatch
(DEFAULT/AVX2/AVX512), never from what the build machine had.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from dynaspec import cpu_features
from dynaspec.models import int8_dot
from dynaspec.models.int8_dot import Int8DotLinear
from dynaspec.models.layers import KernelModule, Linear, keep
from dynaspec.models.quant import QuantizedTensor, quantize_int4, quantize_int8, to_per_channel_int8

log = logging.getLogger("dynaspec")
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# int8dot: dynaspec's int8 dot-product kernel for every row count (flat in width, row-invariant);
# torch: torch's int4/int8 weight-only kernels plus the bf16 copy for wide steps (the wave-2 path);
# auto: int8dot where the C++ kernels build, else torch.
LINEAR_KERNELS = ("auto", "int8dot", "torch")
_ISA_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo "model name"
    capability: str  # torch's run-time kernel dispatch level: DEFAULT | AVX2 | AVX512 | ...
    flags: tuple[str, ...]  # the ISA extensions relevant to the kernels, as the kernel reports them

    def summary(self) -> str:
        isa = " ".join(self.flags) or "none listed"
        return f"{self.model}; torch kernels {self.capability}; ISA {isa}"


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    # cpu_features is the one reader of /proc/cpuinfo; where it cannot be read (not Linux) the
    # model name stays unknown and torch still reports its dispatch.
    flags = cpu_features.cpu_flags()
    return CpuInfo(
        cpu_features.cpu_model_name() or "unknown",
        torch.backends.cpu.get_cpu_capability(),
        tuple(f for f in _ISA_FLAGS if f in flags),
    )


def resolve_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """The mode that will run: "none" where the kernels do not apply, with a log line saying why."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(
            f"unknown quantization {mode!r}: choose one of {', '.join(QUANTIZATION_MODES)}"
        )
    if mode == "none":
        return mode
    why = None
    if device.type != "cpu":
        why = f"the int4/int8 weight-only kernels used here are CPU kernels (device {device.type})"
    elif dtype != torch.bfloat16:
        why = f"the kernels take bf16 activations (dtype {dtype})"
    elif cpu_info().capability == "DEFAULT":
        why = "this CPU offers torch no vector kernels (no AVX2)"
    if why is None:
        return mode
    if mode != "auto":
        raise ValueError(f"--quantization {mode} cannot run here: {why}; use --quantization none")
    log.info("quantization auto -> none: %s; quantized weights are dequantized", why)
    return "none"


class Int4Linear(KernelModule):
    """y = x W^T (+ b) with W int4, one bf16 scale and zero point per 32 weights along K."""

    packed: torch.Tensor  # registered buffers, see __init__
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: QuantizedTensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size = w.group_size
        keep(self, "bias", bias)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            w.q.to(torch.int32).contiguous(), 1))
        # [K / group, N, 2]: (scale, zero) in the activation dtype, as the kernel expects them.
        assert w.zero is not None  # q4 always has its zero points
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous(),
        )
        self.nbytes = w.nbytes_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                       self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


class Int8Linear(KernelModule):
    """y = x W^T (+ b) with W int8 and one bf16 scale per output channel."""

    q: torch.Tensor  # registered buffers, see __init__
    scale_f32: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: QuantizedTensor, bias: torch.Tensor | None) -> None:
        if w.kind != "q8" or w.group_size != w.shape[1]:
            raise ValueError("Int8Linear takes per-channel int8 weights (see to_per_channel_int8)")
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.register_buffer("q", w.q.contiguous())  # [N, K] int8
        keep(self, "bias", bias)
        self.register_buffer(
            "scale_f32", w.scale.reshape(-1).contiguous()
        )  # [N], for exact row lookups
        self.register_buffer(
            "scales", self.scale_f32.to(torch.bfloat16)
        )  # [N], what the kernel takes
        self.nbytes = w.nbytes_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scales)
        return y if self.bias is None else y + self.bias


def dense_rows(m: int) -> int:
    """Rows the bf16 copy runs for an m-row step: m rounded up to a multiple of 8 up to 128, of
    16 up to 256, of 32 up to 512, then of 64 (padding < 8 rows or <= 12.5%). oneDNN keeps native
    state for every distinct row count it sees (measured: ~0.7 MB per count for one 1536x576
    weight, never freed), so exact counts grow RSS with every new step size; buckets bound it."""
    step = 8 if m <= 128 else 16 if m <= 256 else 32 if m <= 512 else 64
    return -(-m // step) * step


class QuantLinear(KernelModule):
    """A quantized kernel for narrow steps and, optionally, a bf16 copy for steps wider than
    dense_above."""

    def __init__(self, kernel: Int4Linear | Int8Linear, dense: Linear | None, dense_above: int,
                 row_buckets: bool = True) -> None:
        super().__init__()
        self.kernel, self.dense, self.dense_above = kernel, dense, dense_above
        self.row_buckets = row_buckets
        self.out_features, self.in_features = kernel.out_features, kernel.in_features
        self.nbytes = kernel.nbytes  # what a narrow (decode) step reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.dense is None or m <= self.dense_above:
            return self.kernel(x)
        if not self.row_buckets or (rows := dense_rows(m)) == m:
            return self.dense(x)
        # Rows are independent in a GEMM: the padded rows are computed and dropped.
        return self.dense(torch.nn.functional.pad(x, (0, 0, 0, rows - m)))[:m]  # [m, out]


class DenseEmbedding(KernelModule):
    weight: torch.Tensor  # registered by keep()

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        keep(self, "weight", weight)  # [vocab, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class Int8Embedding(KernelModule):
    """Rows of a per-channel int8 table (shared with the tied lm_head), dequantized on lookup."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype  # the table is a submodule (shared with the head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.q[ids].float() * self.table.scale_f32[ids, None]  # [T, hidden]
        return rows.to(self.dtype)


class QuantEmbedding(KernelModule):
    """Rows of a GGUF table looked up from its own blocks, dequantized exactly on lookup."""

    def __init__(self, table: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        # The blocks as buffers too (the same tensors the lookup reads), so the module's
        # buffers account for the table.
        self.register_buffer("q", table.q)
        self.register_buffer("scale", table.scale)
        self.register_buffer("zero", table.zero, persistent=table.zero is not None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).dequantize().to(self.dtype)  # [T, hidden]


@dataclass(frozen=True)
class WeightPlan:
    """How the model turns checkpoint weights into kernels: resolved once at start-up."""

    mode: str  # resolved quantization: none | auto | int8 | int4
    dense_above: int  # steps wider than this use a bf16 copy of quantized weights; 0 = no copy
    dtype: torch.dtype
    device: torch.device
    dense_row_buckets: bool = True  # round the bf16 copy's rows up to dense_rows() buckets
    kernel: str = "auto"  # LINEAR_KERNELS

    def int8dot(self, w: QuantizedTensor) -> bool:
        """Whether this weight runs on the int8 dot-product kernel."""
        if self.kernel not in LINEAR_KERNELS:
            raise ValueError(
                f"unknown linear kernel {self.kernel!r}: choose one of {', '.join(LINEAR_KERNELS)}"
            )
        if self.kernel == "torch" or self.device.type != "cpu":
            return False
        if int8_dot.supports(w):
            return True
        if self.kernel == "int8dot" and int8_dot.kernel_isa() == "unavailable":
            raise RuntimeError(
                "--linear-kernel int8dot: the dynaspec CPU kernels are not built here "
                "(see the start-up log; --linear-kernel torch runs torch's kernels)"
            )
        return False

    @property
    def quantized(self) -> bool:
        return self.mode != "none"


def make_linear(w: QuantizedTensor | torch.Tensor, bias: torch.Tensor | None, plan: WeightPlan):
    """The kernel for one weight [N, K]. GGUF blocks keep their own kind; float weights are
    quantized only under int8/int4 (auto leaves them as they are)."""
    if bias is not None:
        bias = bias.to(device=plan.device, dtype=plan.dtype)
    if not plan.quantized:
        full = w.dequantize() if isinstance(w, QuantizedTensor) else w
        return Linear(full.to(device=plan.device, dtype=plan.dtype).contiguous(), bias)
    if not isinstance(w, QuantizedTensor):
        if plan.mode == "auto":
            return Linear(w.to(device=plan.device, dtype=plan.dtype).contiguous(), bias)
        w = _quantize_float(w, plan)
    if plan.int8dot(w):  # one kernel for every row count: no bf16 copy for wide steps
        return Int8DotLinear(w, bias)
    kernel = _kernel(w, bias)
    if kernel is None:
        return Linear(w.dequantize().to(plan.dtype).contiguous(), bias)
    dense = None
    if plan.dense_above > 0:
        dense = Linear(w.dequantize().to(plan.dtype).contiguous(), bias)
    return QuantLinear(kernel, dense, plan.dense_above, plan.dense_row_buckets)


def _quantize_float(w: torch.Tensor, plan: WeightPlan) -> QuantizedTensor:
    """Float weights under --quantization int4/int8: int4 groups of 32 either way; int8 per group
    of 32 where the int8 dot kernel will run it, else per channel (torch's int8 kernel)."""
    if plan.mode == "int4":
        return quantize_int4(w)
    return _grouped_int8(w, plan) or quantize_int8(w)


def _grouped_int8(w: torch.Tensor, plan: WeightPlan) -> QuantizedTensor | None:
    """w as int8 per group of 32 when the int8 dot kernel will run it, else None."""
    if w.shape[1] % 32:
        return None
    grouped = int8_dot.quantize_grouped_int8(w)
    return grouped if plan.int8dot(grouped) else None


def _kernel(w: QuantizedTensor, bias: torch.Tensor | None) -> Int4Linear | Int8Linear | None:
    try:
        if w.kind == "q4":
            return Int4Linear(w, bias)
        return Int8Linear(to_per_channel_int8(w), bias)
    except RuntimeError as exc:  # a shape the packing op rejects: this one weight runs dense
        log.info(
            "weight [%d, %d] runs dense: the %s kernel rejected it (%s)", *w.shape, w.kind, exc
        )
        return None


def make_embedding(w: QuantizedTensor | torch.Tensor, plan: WeightPlan, tied: bool):
    """(embedding, lm_head if tied else None).

    A GGUF table keeps the file's own precision: rows are looked up from its blocks exactly, and
    a tied head runs its Q4 blocks through the int4 kernel, or a Q8_0 table (per-32 scales, which
    the int8 kernel cannot take) as exact bf16: requantizing it to per-channel int8 measured
    top-1 0.94 against 0.96 for bf16 over 2,000 positions of the default model, for no speed
    gain at one thread. Float weights under int8/int4 get one per-channel int8 table for both.
    """
    if not _quantize_head(w, plan):
        dense = (w.dequantize() if isinstance(w, QuantizedTensor) else w).to(
            device=plan.device, dtype=plan.dtype
        )
        return DenseEmbedding(dense.contiguous()), (Linear(dense.contiguous()) if tied else None)
    if isinstance(w, QuantizedTensor):
        return QuantEmbedding(w, plan.dtype), (make_lm_head(w, plan) if tied else None)
    head = _int8_head(w, plan)
    if isinstance(head, Int8DotLinear):
        assert head.source is not None  # _int8_head keeps the groups (keep_source=True)
        return QuantEmbedding(head.source, plan.dtype), (head if tied else None)
    assert isinstance(head.kernel, Int8Linear)  # _int8_head's per-channel int8 table
    return Int8Embedding(head.kernel, plan.dtype), (head if tied else None)


def make_lm_head(w: QuantizedTensor | torch.Tensor, plan: WeightPlan):
    """The output matrix: Q4 blocks through the int4 kernel, Q8_0 as exact bf16, float weights
    as per-channel int8 under int8/int4 (see make_embedding)."""
    if not _quantize_head(w, plan):
        return make_linear(w, None, WeightPlan("none", 0, plan.dtype, plan.device))
    if isinstance(w, QuantizedTensor):
        if w.kind == "q4" or plan.int8dot(w):
            return make_linear(w, None, plan)
        return Linear(w.dequantize().to(device=plan.device, dtype=plan.dtype).contiguous())
    return _int8_head(w, plan)


def _quantize_head(w: QuantizedTensor | torch.Tensor, plan: WeightPlan) -> bool:
    return plan.quantized and (isinstance(w, QuantizedTensor) or plan.mode in ("int8", "int4"))


def _int8_head(w: torch.Tensor, plan: WeightPlan) -> QuantLinear | Int8DotLinear:
    grouped = _grouped_int8(w, plan)
    if grouped is not None:
        return Int8DotLinear(grouped, None, keep_source=True)
    table = Int8Linear(quantize_int8(w), None)
    dense = None
    if plan.dense_above > 0:
        dense = Linear((table.q.float() * table.scale_f32[:, None]).to(plan.dtype).contiguous())
    return QuantLinear(table, dense, plan.dense_above, plan.dense_row_buckets)


def linear_kernel_summary(model) -> str:
    """Which kernels the model's matrices run on, e.g. "int8dot avx512_vnni (211 matrices)"."""
    counts: dict[str, int] = {}
    mats = [model.lm_head] + [
        m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    for m in mats:
        isa = f"int8dot {int8_dot.kernel_isa()}"
        name = {Int8DotLinear: isa, int8_dot.Int8DotHead: isa, QuantLinear: "torch int4/int8",
                Linear: "dense"}.get(type(m), type(m).__name__)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} ({v} matrices)" for k, v in counts.items())
