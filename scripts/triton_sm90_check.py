"""Compile every Triton kernel of the GPU path for sm_90 (the H200) on a machine without a GPU:
catches front-end and ptxas errors before a device call. Needs triton (its wheel carries ptxas).
Usage: PYTHONPATH=. python scripts/triton_sm90_check.py   (TRITON_INTERPRET must be unset)"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dynaspec.attention import triton_paged as tp
from dynaspec.models import gpu_ops as go

TARGET = GPUTarget("cuda", 90, 32)
C = "constexpr"


def comp(fn, sig: dict, consts: dict) -> None:
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)
    print(f"{fn.__name__}: ok, {k.metadata.num_warps} warps, {k.metadata.shared} B shared")


def main() -> None:
    for dt in ("bf16", "fp32"):
        p = f"*{dt}"
        attn = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": p, "bt_ptr": "*i64",
                "ctx_ptr": "*i64", "qstart_ptr": "*i64", "qlen_ptr": "*i64",
                **{s: "i32" for s in ("stride_qt", "stride_qh", "stride_ks", "stride_kh",
                                      "stride_ot", "stride_oh", "stride_bt")},
                "scale": "fp32", "window": "i32", "G": C, "D": C, "BLOCK_D": C, "BS": C,
                "BLOCK_M": C, "BLOCK_N": C, "PREC": C}
        comp(tp._paged_attn_kernel, attn, {"G": 3, "D": 64, "BLOCK_D": 64, "BS": 16,
                                           "BLOCK_M": tp.BLOCK_M, "BLOCK_N": tp.BLOCK_N,
                                           "PREC": "ieee" if dt == "fp32" else "tf32"})
        kv = {"k_ptr": p, "v_ptr": p, "cache_ptr": p, "slot_ptr": "*i64", "stride_kt": "i32",
              "stride_vt": "i32", "stride_c0": "i64", "HD": C, "BLOCK": C, "HEAD_D": C,
              "stride_kh": "i32", "stride_vh": "i32"}
        comp(tp._write_kv_kernel, kv, {"HD": 192, "BLOCK": 256, "HEAD_D": 64})
        rms = {"x_ptr": p, "d_ptr": p, "w_ptr": p, "sum_ptr": p, "out_ptr": p, "n": "i32",
               "eps": "fp32", "stride_x": "i32", "stride_d": "i32", "HAS_DELTA": C, "BLOCK": C}
        for has_delta in (True, False):
            comp(go._rms_kernel, rms, {"HAS_DELTA": has_delta, "BLOCK": 1024})
        rope = {"qkv_ptr": p, "cos_ptr": p, "sin_ptr": p, "out_ptr": p, "stride_t": "i32",
                "stride_c": "i32", "HALF": C, "HEADS": C, "BLOCK_H": C, "BLOCK_D": C}
        comp(go._rope_kernel, rope, {"HALF": 32, "HEADS": 12, "BLOCK_H": 16, "BLOCK_D": 32})
        silu = {"x_ptr": p, "out_ptr": p, "n": "i32", "stride_x": "i32", "BLOCK": C}
        comp(go._silu_mul_kernel, silu, {"BLOCK": 1024})


if __name__ == "__main__":
    main()
