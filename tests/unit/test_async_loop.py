"""The pipelined driver's threads: the forward worker keeps the engine's torch thread count while
the engine thread drops to one."""

from __future__ import annotations

import torch

from dynaspec.engine.async_loop import AsyncStepLoop


def test_the_forward_worker_keeps_the_engines_thread_count():
    """torch sets a thread's count lazily from the process-wide value, which the engine thread
    sets to 1: the worker's forward ran on one thread (c8 chat: 152 against sync's 227 tok/s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    loop = AsyncStepLoop(engine=None)
    try:
        assert torch.get_num_threads() == 1  # the engine thread's own ops
        assert loop.worker.submit(torch.get_num_threads).result() == 2
    finally:
        loop.close()
        torch.set_num_threads(before)
