"""Tensors in huge pages: zeros like torch.zeros, on a 2 MB boundary where huge pages are allowed,
an ordinary allocation where they are refused or the tensor is small."""

from __future__ import annotations

import sys

import pytest
import torch

from dynaspec.models import huge_pages

SHAPE = (2, 4096, 3, 64)  # 3 MB of bf16: one KV layer of a small pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_zeros_on_a_huge_page_boundary(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_allowed", lambda: True)
    t = huge_pages.zeros(SHAPE, torch.bfloat16)
    assert t.shape == SHAPE and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert not t.any()
    t[1, 4095] = 1.5  # the last element is inside the mapping and kept
    assert t.float().sum().item() == 1.5 * 3 * 64


def test_refused_or_small_is_an_ordinary_allocation(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_allowed", lambda: False)
    t = huge_pages.zeros(SHAPE, torch.float32)
    assert t.shape == SHAPE and t.dtype == torch.float32 and not t.any()
    monkeypatch.setattr(huge_pages, "thp_allowed", lambda: True)
    small = huge_pages.zeros((4, 8), torch.float32)
    assert small.shape == (4, 8) and not small.any()
