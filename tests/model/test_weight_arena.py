"""Packed weights moved into one huge-page block: the same bits, one allocation, nothing lost
where huge pages are refused."""

from __future__ import annotations

import pytest
import torch

from dynaspec.models import huge_pages, int8_dot, weight_arena
from dynaspec.models.int8_dot import Int8DotLinear
from dynaspec.models.quant import quantize_int4

pytestmark = pytest.mark.skipif(
    int8_dot.kernel_isa() == "unavailable", reason="the C++ kernels are not built"
)


def _model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    return torch.nn.Sequential(*(Int8DotLinear(quantize_int4(torch.randn(n, 64, generator=g)),
                                               None) for n in (64, 48, 64)))


def _run(m: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [lin(x) for lin in m]


def test_weights_move_into_one_block_and_compute_the_same(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_allowed", lambda: True)
    m = _model()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    before = _run(m, x)
    old = [lin.packed for lin in m]
    moved = weight_arena.place_weights(m, Int8DotLinear)
    assert moved >= sum(t.numel() for t in old)
    storages = {lin.packed.untyped_storage().data_ptr() for lin in m}
    storages |= {lin.scales.untyped_storage().data_ptr() for lin in m}
    assert len(storages) == 1  # one allocation for every buffer
    assert all(lin.packed.data_ptr() % weight_arena.ALIGN == 0 for lin in m)
    assert all(torch.equal(a, b.packed) for a, b in zip(old, m))
    assert all(torch.equal(a, b) for a, b in zip(before, _run(m, x)))


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_allowed", lambda: False)
    m = _model()
    old = [lin.packed.data_ptr() for lin in m]
    assert weight_arena.place_weights(m, Int8DotLinear) == 0
    assert [lin.packed.data_ptr() for lin in m] == old
