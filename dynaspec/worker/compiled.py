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

CUDA: one `torch.cuda.CUDAGraph` per shape over the same buffers, covering the whole step up to
the logits and their argmax (`CudaGraphDecode`); attention is the in-place Triton kernel, so a
replay reads each row's own context, not the block table's full width.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dynaspec.attention.backend import AttentionBackend, AttentionBatch
from dynaspec.attention.uniform import DecodeMetadata, UniformDecodeBackend
from dynaspec.models.llama import LlamaModel

if TYPE_CHECKING:
    from dynaspec.attention.gpu_paged import GpuPagedBackend

log = logging.getLogger("dynaspec")


class MetadataBuilder(Protocol):
    def build_metadata(self, batch: Any) -> Any: ...


class FixedShapeExecutor(Protocol):
    path: str  # "compiled" | "cuda_graph"
    build_seconds: dict[tuple[int, int], float]

    @property
    def backend(self) -> MetadataBuilder:
        """Builds a step's metadata from its AttentionBatch (what `run` takes as md)."""
        ...

    def ready(self, num_reqs_padded: int, width: int) -> bool:
        """False when the shape is broken or its build would exceed the budget."""
        ...

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor | None, md: Any) -> Any:
        """input_ids, positions: [B_pad*W]. "compiled" returns the normed hidden states
        [B_pad*W, hidden]: the runner applies the model's head outside the graph
        (`LlamaModel.head`), as the eager path does, so both give every row the same logits.
        "cuda_graph" derives positions in the graph (None) and returns (logits, argmax)."""
        ...

    def fail(self, key: tuple[int, int], exc: BaseException) -> None:
        """Mark the shape broken (its steps run eager), saying why."""
        ...


class _Base:
    path = "compiled"

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], budget_s: float) -> None:
        self.model, self.kv_caches, self.budget_s = model, kv_caches, budget_s
        self.attn: AttentionBackend = UniformDecodeBackend(pin_blocks=self.path == "cuda_graph")
        self.backend: MetadataBuilder = self.attn  # the runner builds each step's md with it
        self.build_seconds: dict[tuple[int, int], float] = {}
        self.broken: set[tuple[int, int]] = set()
        self.errors: dict[tuple[int, int], str] = {}  # why each broken shape broke
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
            input_ids, positions, self.kv_caches, md, None, self.attn, head=False
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
        self.errors[key] = f"{type(exc).__name__}: {exc}"[:500]
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

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], budget_s: float,
                 num_shapes: int, backend: str = "inductor") -> None:
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
        self, input_ids: torch.Tensor, positions: torch.Tensor | None, md: DecodeMetadata
    ) -> torch.Tensor:
        from torch._dynamo.utils import counters

        if positions is None:
            raise ValueError("the compiled step takes the positions of its rows")
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


@dataclass(frozen=True)
class GraphStepInputs:
    """What a captured step reads besides the token ids: views of the runner's persistent
    buffers (fixed addresses), filled in place before each replay."""

    block_tables: torch.Tensor  # [B_pad, max_blocks] long; columns past a row's context unread
    context_lens: torch.Tensor  # [B_pad] long
    width: int
    block_size: int


class _GraphInputsFiller:
    """The runner calls `executor.backend.build_metadata(batch)`: for the CUDA-graph path that
    only fills the buffers (block table as wide as this step needs, context lengths); the slot
    mapping and positions are derived inside the graph."""

    name = "gpu_paged"

    def __init__(self, backend: GpuPagedBackend) -> None:
        self.backend = backend

    def build_metadata(self, batch: AttentionBatch) -> GraphStepInputs:
        tables, ctx = self.backend.fill_fixed(batch)
        assert batch.width is not None  # a fixed-shape batch has one
        return GraphStepInputs(tables, ctx, batch.width, batch.block_size)


_Logits = tuple[torch.Tensor, torch.Tensor]  # logits [B*W, vocab] float32, argmax [B*W]
# A captured step: the graph, its outputs (replays write them) and the inputs it reads.
_Captured = tuple[Any, _Logits, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class CudaGraphDecode(_Base):
    """CUDA: one FULL graph per (bucket, width) for the whole decode/verify step: positions and
    slots from the context lengths, the body with in-place paged attention (gpu_paged), the head
    for every row and each row's argmax. `run` returns (logits [B*W, vocab] float32, argmax
    [B*W] long): a greedy step then needs one device-to-host copy of the argmax (the runner's
    `_sample`); other steps sample from the logits outside the graph."""

    path = "cuda_graph"

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], budget_s: float,
                 capture: bool = True) -> None:
        super().__init__(model, kv_caches, budget_s)
        from dynaspec.attention.gpu_paged import GpuPagedBackend

        self.capture = capture  # False: run the step uncaptured (CPU tests, interpreter)

        attn = GpuPagedBackend()
        self.attn, self.backend = attn, _GraphInputsFiller(attn)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool: Any = None  # the captured graphs' shared memory pool (torch's handle)

    def _graph_step(self, input_ids: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, width: int, block_size: int) -> _Logits:
        from dynaspec.attention.gpu_paged import fixed_metadata

        md = fixed_metadata(block_tables, context_lens, width, block_size)
        ar = torch.arange(width, device=context_lens.device)
        positions = (context_lens[:, None] - width + ar).reshape(-1)  # [B*W]
        h = self.model.forward_traceable(input_ids, positions, self.kv_caches, md, None,
                                         self.attn, head=False)  # [B*W, hidden]
        logits = self.model.head(h)  # [B*W, vocab] float32
        return logits, logits.argmax(dim=-1)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor | None,
            md: GraphStepInputs) -> _Logits:
        key = (md.context_lens.shape[0], md.width)
        args = (input_ids, md.block_tables, md.context_lens)
        if not self.capture:
            with torch.inference_mode():
                return self._graph_step(*args, md.width, md.block_size)
        entry = self.graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = self._capture(args, md.width, md.block_size)
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

    def _capture(self, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor], width: int,
                 block_size: int) -> _Captured:
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # this step for real (KV writes, Triton compiles)
                warm = self._graph_step(*args, width, block_size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Capture records kernels without running them, so the KV writes are not repeated.
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._graph_step(*args, width, block_size)
            self.pool = graph.pool()
            for o, w in zip(out, warm):
                o.copy_(w)
        return graph, out, args


def make_executor(model: LlamaModel, kv_caches: list[torch.Tensor], device: torch.device,
                  budget_s: float, num_shapes: int, compile_backend: str = "inductor"
                  ) -> FixedShapeExecutor | None:
    if device.type == "cuda":
        from dynaspec.attention.gpu_paged import available

        ok, why = available(device)
        if not ok:  # the runner then runs every step eager (always correct)
            log.warning("CUDA graphs off: the whole-step graph needs the gpu_paged kernel: %s",
                        why)
            return None
        return CudaGraphDecode(model, kv_caches, budget_s)
    return CompiledDecode(model, kv_caches, budget_s, num_shapes, compile_backend)
