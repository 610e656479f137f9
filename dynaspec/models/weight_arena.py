"""The packed weights of a model in one block of 2 MB transparent huge pages (CPU, Linux).

A decode step streams every weight once. Each matrix is its own allocation under 2 MB, so it
lands in 4 KB pages: ~20,000 page walks a step (costly in a VM, where each is a nested walk), and
the hardware prefetchers stop at every 4 KB boundary. Thirty layers of SmolLM2's matrices in one
huge-page block ran 1 / 5 / 16 rows in 0.90 / 0.83 / 0.93x the time of one 4 KB-page block
(docs/history/benchmarks-waves-1-4.md, sixth session). The values are copied bit for bit, so nothing
computed changes. Where the system refuses huge pages (THP off, not Linux) the copy is not made and
the weights stay where they are.
"""

from __future__ import annotations

import logging

import torch

from dynaspec.models.huge_pages import huge_block

log = logging.getLogger("dynaspec")
ALIGN = 64  # every tensor starts on a cache line
_NAMES = ("packed", "scales", "mins")


def place_weights(model: torch.nn.Module, kind: type) -> int:
    """Move the packed buffers of every `kind` module in `model` (the int8 kernel's linears)
    into one huge-page block; returns the bytes moved (0: left as they were). Call before anything
    else holds those tensors (the C++ layer stack takes them at its construction)."""
    mods = [m for m in model.modules() if isinstance(m, kind)]
    tensors = [(m, n, getattr(m, n)) for m in mods for n in _NAMES if getattr(m, n) is not None]
    if not tensors or any(t.device.type != "cpu" for _, _, t in tensors):
        return 0
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t in tensors]
    got = huge_block(sum(sizes))
    if got is None:
        log.info("huge pages unavailable: weights stay in 4 KB pages")
        return 0
    block, off = got
    base = torch.frombuffer(block, dtype=torch.uint8)  # the tensors keep the mapping alive
    for (m, name, t), size in zip(tensors, sizes):
        nbytes = t.numel() * t.element_size()
        view = base[off: off + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        setattr(m, name, view)
        off += size
    return sum(sizes)
