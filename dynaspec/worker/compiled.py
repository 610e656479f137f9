"""Fixed-shape decode/verify executors: `torch.compile` on the CPU, CUDA graphs on CUDA.

Both run the target forward with the uniform attention backend over the runner's persistent
buffers, one specialisation per (padded request count, width) of the execution grid, built
lazily on the shape's first step. Build time is logged per shape and bounded: once the total
passes `budget_s`, shapes not built yet run eager (logged once), so a long grid cannot stall
serving indefinitely. A shape whose build fails is marked broken and runs eager from then on;
eager is always available and always correct.

CPU: one `torch.compile(fullgraph=True)` entry; dynamo specialises on the static shapes (B*W
tokens, B rows) and the block-table width is marked dynamic, so a longer context never
recompiles. Inductor's FX-graph and AOT caches are on, so a second launch with the same model
and shapes loads the compiled kernels instead of rebuilding them (set TORCHINDUCTOR_CACHE_DIR to
keep them somewhere durable).

CUDA: one `torch.cuda.CUDAGraph` per shape over the same buffers (block table pinned to its full
width so every address and shape is fixed). Written against the torch CUDA-graph API; it has not
run on a GPU here (README says so).
"""

from __future__ import annotations

import logging
import time
import types
from typing import Protocol

import torch

from dynaspec.attention.uniform import DecodeMetadata, UniformDecodeBackend

log = logging.getLogger("dynaspec")


class FixedShapeExecutor(Protocol):
    path: str  # "compiled" | "cuda_graph"
    backend: UniformDecodeBackend
    build_seconds: dict[tuple[int, int], float]

    def ready(self, num_reqs_padded: int, width: int) -> bool:
        """False when the shape is broken or its build would exceed the budget."""
        ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: DecodeMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [B_pad*W]. Returns the normed hidden states [B_pad*W, hidden]:
        the runner applies the model's head outside the graph (`LlamaModel.head`), as the eager
        path does, so both give every row the same logits."""
        ...


class _Base:
    path = "compiled"

    def __init__(self, model, kv_caches: list[torch.Tensor], budget_s: float) -> None:
        self.model, self.kv_caches, self.budget_s = model, kv_caches, budget_s
        self.backend = UniformDecodeBackend(pin_blocks=self.path == "cuda_graph")
        self.build_seconds: dict[tuple[int, int], float] = {}
        self.broken: set[tuple[int, int]] = set()
        self._budget_logged = False

    @property
    def total_build_seconds(self) -> float:
        return sum(self.build_seconds.values())

    def ready(self, num_reqs_padded: int, width: int) -> bool:
        key = (num_reqs_padded, width)
        if key in self.broken:
            return False
        if key in self.build_seconds:
            return True
        if self.total_build_seconds >= self.budget_s:
            if not self._budget_logged:
                log.warning(
                    "%s build budget %.0f s spent (%.1f s over %d shapes): shapes not built "
                    "yet run eager",
                    self.path,
                    self.budget_s,
                    self.total_build_seconds,
                    len(self.build_seconds),
                )
                self._budget_logged = True
            return False
        return True

    def _step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        width = input_ids.shape[0] // context_lens.shape[0]
        md = DecodeMetadata(slot_mapping, block_tables, context_lens, block_size, width)
        return self.model.forward_traceable(
            input_ids, positions, self.kv_caches, md, None, self.backend, head=False
        )

    def _built(self, key: tuple[int, int], seconds: float) -> None:
        self.build_seconds[key] = seconds
        log.info(
            "%s decode shape (requests %d, width %d) built in %.1f s (%.1f s total, %d shapes)",
            self.path,
            key[0],
            key[1],
            seconds,
            self.total_build_seconds,
            len(self.build_seconds),
        )

    def fail(self, key: tuple[int, int], exc: BaseException) -> None:
        self.broken.add(key)
        log.error(
            "%s decode shape (requests %d, width %d) failed, running it eager from now on: %s",
            self.path,
            key[0],
            key[1],
            exc,
        )


class CompiledDecode(_Base):
    """CPU: torch.compile of the decode/verify step."""

    path = "compiled"

    def __init__(self, model, kv_caches: list[torch.Tensor], budget_s: float, num_shapes: int,
                 backend: str = "inductor") -> None:
        super().__init__(model, kv_caches, budget_s)
        import torch._dynamo.config as dcfg
        import torch._inductor.config as icfg

        # Dynamo keys its cache (and its recompile limit) on the code object. A private copy of
        # `_step`'s code gives this executor its own cache, so engines in one process do not
        # share a budget, and each grid shape is one specialisation of it. Past the limit dynamo
        # would silently run the step uncompiled: make that an error (the shape then runs eager,
        # logged) and check below that every new shape really produced a graph.
        dcfg.recompile_limit = max(dcfg.recompile_limit, num_shapes + 4)
        dcfg.fail_on_recompile_limit_hit = True
        icfg.fx_graph_cache = True
        f = type(self)._step
        fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                                   f.__closure__)
        self._fn = torch.compile(types.MethodType(fresh, self), backend=backend, dynamic=False,
                                 fullgraph=True)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: DecodeMetadata
    ) -> torch.Tensor:
        from torch._dynamo.utils import counters

        key = (md.context_lens.shape[0], md.width)
        torch._dynamo.mark_dynamic(md.block_tables, 1)
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        with torch.no_grad():
            out = self._fn(input_ids, positions, md.slot_mapping, md.block_tables, md.context_lens,
                           md.block_size)
        if key not in self.build_seconds:
            if counters["stats"]["unique_graphs"] == graphs:
                raise RuntimeError(
                    "torch.compile produced no graph for a new shape (it ran uncompiled)"
                )
            self._built(key, time.perf_counter() - t0)
        return out


class CudaGraphDecode(_Base):
    """CUDA: one captured graph per shape; replay after copying inputs into the same buffers."""

    path = "cuda_graph"

    def __init__(self, model, kv_caches: list[torch.Tensor], budget_s: float) -> None:
        super().__init__(model, kv_caches, budget_s)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}
        self.pool = None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: DecodeMetadata
    ) -> torch.Tensor:
        key = (md.context_lens.shape[0], md.width)
        args = (input_ids, positions, md.slot_mapping, md.block_tables, md.context_lens)
        entry = self.graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = self._capture(args, md.block_size)
            self.graphs[key] = entry
            self._built(key, time.perf_counter() - t0)
            return entry[1]  # the warm-up ran this step for real; its output is valid
        graph, out, captured = entry
        if any(a.data_ptr() != c.data_ptr() for a, c in zip(args, captured)):
            raise RuntimeError(
                "CUDA graph inputs moved: the runner must pass its persistent buffers"
            )
        graph.replay()
        return out

    def _capture(self, args: tuple, block_size: int):
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                warm = self._step(*args, block_size)  # this step, computed for real (KV writes too)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Capture records kernels without running them, so the KV writes are not repeated.
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._step(*args, block_size)
            self.pool = graph.pool()
            out.copy_(warm)
        return graph, out, args


def make_executor(model, kv_caches: list[torch.Tensor], device: torch.device, budget_s: float,
                  num_shapes: int, compile_backend: str = "inductor") -> FixedShapeExecutor:
    if device.type == "cuda":
        return CudaGraphDecode(model, kv_caches, budget_s)
    return CompiledDecode(model, kv_caches, budget_s, num_shapes, compile_backend)
