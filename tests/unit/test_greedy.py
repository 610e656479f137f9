"""The greedy choice (sample/greedy.py) returns torch.argmax's indices: ties, NaN, inf, tails."""

from __future__ import annotations

import pytest
import torch

from dynaspec import cpu_kernels
from dynaspec.sample.greedy import argmax_rows

ok, why = cpu_kernels.available()
needs_kernels = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernels: {why}")


def _rows(m: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152, 49155])
def test_kernel_equals_torch_argmax(n):
    x = _rows(9, n)
    # A tie for the maximum in row 0 (the first wins), the maximum in the unvectorised tail of
    # row 1, every value equal in row 2, -inf everywhere in row 3, +inf twice in row 4.
    x[0, n // 2] = x[0, n - 1] = 50.0
    x[1, n - 1] = 60.0
    x[2] = 1.0
    x[3] = float("-inf")
    x[4, n // 3] = x[4, n - 1] = float("inf")
    mod = cpu_kernels.extension()
    assert torch.equal(mod.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@needs_kernels
def test_nan_ranks_above_every_number_as_in_torch():
    x = _rows(3, 100)
    x[0, 70] = float("nan")
    x[0, 90] = float("nan")
    x[1, 5] = float("inf")
    x[1, 99] = float("nan")  # a NaN in the tail beats an earlier +inf
    got = cpu_kernels.extension().argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist() == [70, 99, int(x[2].argmax())]


@needs_kernels
def test_kernel_refuses_what_it_does_not_read():
    mod = cpu_kernels.extension()
    with pytest.raises(RuntimeError, match="argmax_rows: contiguous float32"):
        mod.argmax_rows(_rows(2, 8).t())
    with pytest.raises(RuntimeError, match="argmax_rows: contiguous float32"):
        mod.argmax_rows(_rows(2, 8).bfloat16())


def test_other_inputs_fall_back_to_torch():
    x = _rows(4, 33)
    for t in (x.t(), x.bfloat16(), x[0], x.double()):
        assert torch.equal(argmax_rows(t), t.argmax(dim=-1))
    empty = torch.empty(0, 5)
    assert argmax_rows(empty).shape == (0,)
