"""`dynaspec bench decode`: steady-state decode speed beside this machine's bandwidth limit.

The limit is (weight bytes one decode step reads) / (measured read bandwidth): a batch-b decode
step cannot beat it on a machine that must stream every weight once per step.

With --widths it times verify-shaped steps instead: the widths take turns step by step within
each round, and each width's cost is reported as a ratio to width 1 formed round by round, with
its spread, so one run's ratio can be told from noise and compared with the next run's.

What made two runs disagree (docs/results/cpu-decode.md, 2-vCPU Zen 4 VM): (1) too few rounds:
a step's time has a long right tail (width 1: 5th-95th percentile 4.4-6.3 ms at a 4.8 ms median),
and the median ratio of 5 rounds varied by up to 14% between groups of rounds of one idle run,
of 20 rounds by under 3%: so 30 rounds by default (a round's sample is the median of its steps,
the ratio the median of the rounds') and a whole round of warm-up; (2) others' work beside the
run (10-47% of the CPUs' time moved width 9's ratio by up to 25%): LoadMeter records it per
shape and the report warns. Not removed: with under 1% load by others, width 9 ran at one of
two levels (6.5 or 8.5 ms at ctx 128, width 1 ~4.2 vs 4.7) for seconds at a time, a whole run
or part of one: compute-bound steps slowed by ~30%, memory-bound ones ~10%, which steal time
does not show (another tenant on the host's cores, presumably). Within a run the rounds then
agree (IQR +-2%), so compare runs with their step times, not their ratios alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynaspec.bench.machine import LoadMeter
from dynaspec.bench.stats import paired_ratio
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.engine.step_recorder import StepTimes
from dynaspec.models.quant_linear import cpu_info
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.policy.cost_profile import synthetic_step


def measure_read_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (sum over a buffer far larger than the caches)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def measure_device_bandwidth(device: torch.device, num_bytes: int = 1 << 30,
                             repeats: int = 5) -> float:
    """CUDA: bytes/s of a device-to-device copy (bytes read + bytes written), the HBM figure a
    decode step's weight reads are bounded by. On the CPU: `measure_read_bandwidth`."""
    if device.type != "cuda":
        return measure_read_bandwidth()
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return num_bytes / best


def measure_launch_cost(device: torch.device, n: int = 200) -> dict:
    """Seconds per tiny kernel: launched one by one from Python (eager) and replayed from a
    CUDA graph. kernels per step x the graph figure is the launch-bound floor of a step."""
    x = torch.zeros(16, device=device)
    for _ in range(10):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / n
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return {"eager_s": eager, "graph_s": (time.perf_counter() - t0) / (5 * n)}


def kernels_per_step(step) -> int:
    """CUDA kernels one call of `step` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def run_decode(engine: LLMEngine, batch: int, prompt_len: int, gen_tokens: int) -> dict:
    """Prefill `batch` prompts, then time only the steps where every request decodes."""
    vocab = engine.parts.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    for _ in range(batch):
        ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
        engine.add_request(ids, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    engine.recorder.times = StepTimes()
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    t = engine.times
    split = {k: v / max(t.steps, 1) * 1e3 for k, v in asdict(t).items() if k != "steps"}
    step_ms = elapsed / max(t.steps, 1) * 1e3
    return {
        "batch": batch,
        "context": prompt_len,
        "tokens_per_s": tokens / elapsed,
        "step_ms": step_ms,
        "steps": t.steps,
        "phase_ms": split,
        "outside_forward_pct": 100 * (1 - split["forward"] / step_ms) if step_ms else 0.0,
    }


def report(engine: LLMEngine, results: list[dict], bandwidth: float) -> str:
    wbytes = engine.parts.model.weight_bytes_per_step()
    limit_step_s = wbytes / bandwidth
    m = engine.parts.model
    cuda = m.device.type == "cuda"
    where = f"GPU: {torch.cuda.get_device_name(m.device)}" if cuda else \
        f"CPU: {cpu_info().summary()}"
    lines = [
        f"model {engine.parts.model_name}, dtype {m.dtype}, quantization {m.weights.mode}, "
        f"attention {m.attn.name}, {torch.get_num_threads()} threads",
        where,
        f"weights read per step (kernel formats): {wbytes / 1e6:.1f} MB; "
        f"{'HBM copy' if cuda else 'read'} bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; bandwidth-limited step {limit_step_s * 1e3:.3f} ms",
        "| batch | context | tok/s | step ms | limit tok/s | % of limit | schedule | prepare | "
        "forward | sample | update | outside fwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        limit = r["batch"] / limit_step_s
        p = r["phase_ms"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
            f"{limit:.1f} | "
            f"{100 * r['tokens_per_s'] / limit:.0f}% | {p['schedule']:.2f} | {p['prepare']:.2f} | "
            f"{p['forward']:.2f} | {p['sample']:.2f} | {p['update']:.2f} | "
            f"{r['outside_forward_pct']:.1f}% |"
        )
    return "\n".join(lines)


def interleaved_times(steps_by_width: Mapping[int, Callable[[], object]], rounds: int, steps: int,
                      clock: Callable[[], float] = time.perf_counter) -> dict[int, list[float]]:
    """ms per step of each width, one sample per round: within a round the widths take turns
    step by step (1 5 9 1 5 9 ...), so drift (clock frequency, a neighbour's load) lands on every
    width alike, and a width's sample is the median of its `steps` steps in that round."""
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1, got rounds={rounds}, steps={steps}")
    samples: dict[int, list[float]] = {w: [] for w in steps_by_width}
    for _ in range(rounds):
        times: dict[int, list[float]] = {w: [] for w in steps_by_width}
        for _ in range(steps):
            for w, step in steps_by_width.items():
                t0 = clock()
                step()
                times[w].append(clock() - t0)
        for w, t in times.items():
            samples[w].append(statistics.median(t) * 1e3)
    return samples


@dataclass(frozen=True)
class WidthRatio:
    """verify(w) / verify(1) over rounds, each round's ratio formed from its own width-1 time."""

    median: float
    q1: float  # quartiles of the per-round ratios: their spread
    q3: float
    geomean: float  # centre of the paired interval below
    ci_lo: float | None  # 95% t interval of the mean log ratio; None with one round
    ci_hi: float | None
    n: int

    def fmt(self) -> str:
        ci = "" if self.ci_lo is None else f"; 95% CI {self.ci_lo:.3f}-{self.ci_hi:.3f}"
        return f"{self.median:.3f} (IQR {self.q1:.3f}-{self.q3:.3f}{ci}, n={self.n})"


def width_ratio(width_ms: Sequence[float], base_ms: Sequence[float]) -> WidthRatio:
    """The ratio of paired per-round samples (width w, width 1) with its spread."""
    est = paired_ratio(base_ms, width_ms)
    ratios = [w / b for w, b in zip(width_ms, base_ms)]
    q1, med, q3 = (float(np.percentile(ratios, q)) for q in (25, 50, 75))
    return WidthRatio(med, q1, q3, est.ratio, est.lo, est.hi, est.n)


# Above these shares of the machine's time given to others during a run, its numbers are not an
# idle machine's: the report says so.
BUSY_WARN_PCT = 5.0
STEAL_WARN_PCT = 2.0


def run_widths(engine: LLMEngine, batches: list[int], contexts: list[int], widths: list[int],
               rounds: int = 30, steps: int = 5) -> list[dict]:
    """Step time per (batch, context, width), the widths of one shape interleaved step by step
    (interleaved_times); a width's time is the median over rounds, its ratio to width 1 is
    width_ratio over the same rounds (None where width 1 was not timed); each row also has
    the machine's load by others while its shape ran (LoadMeter)."""
    p = engine.parts
    cc = engine.config.cache
    out = []
    for b in batches:
        for c in contexts:
            fns = {
                w: synthetic_step(
                    p.model, p.runner.kv_caches, cc.block_size, p.kv.num_blocks, b, c, w
                )
                for w in widths
            }
            interleaved_times(fns, rounds=1, steps=steps)  # warm-up: oneDNN primitives, caches
            meter = LoadMeter()
            samples = interleaved_times(fns, rounds, steps)
            load = meter.read()
            for w in widths:
                out.append({**_width_row(b, c, w, samples[w], samples.get(1)), "load": load})
    return out


def _width_row(batch: int, ctx: int, width: int, ms: list[float],
               base_ms: list[float] | None) -> dict:
    ratio = width_ratio(ms, base_ms) if base_ms else None
    q1, q3 = (float(np.percentile(ms, q)) for q in (25, 75))
    return {
        "batch": batch,
        "context_len": ctx,
        "width": width,
        "step_ms": statistics.median(ms),
        "step_ms_iqr": [q1, q3],
        "ratio_to_width_1": ratio.median if ratio else None,
        "ratio": asdict(ratio) if ratio else None,
        "samples_ms": ms,
    }


def report_widths(engine: LLMEngine, results: list[dict], bandwidth: float,
                  machine: dict | None = None) -> str:
    from dynaspec.models.quant_linear import linear_kernel_summary

    m = engine.parts.model
    wbytes = m.weight_bytes_per_step()
    limit_ms = wbytes / bandwidth * 1e3
    lines = [
        f"model {engine.parts.model_name}, {torch.get_num_threads()} threads, linear kernel "
        f"{linear_kernel_summary(m)}, attention {m.attn.name}",
        f"CPU: {cpu_info().summary()}",
    ]
    if machine:
        paths = " ".join(f"{k}={v}" for k, v in machine["kernel_paths"].items())
        git = machine["git"]
        rev = "no checkout" if git is None else \
            f"{git['commit'][:12]}{' (uncommitted changes)' if git['dirty'] else ''}"
        lines.append(f"kernel paths: {paths}; commit {rev}; torch {machine['torch']}")
    lines += [
        f"weights read per step: {wbytes / 1e6:.1f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"bandwidth-limited step {limit_ms:.2f} ms",
        "| batch | context | width | step ms | step ms IQR | / width 1 | ratio IQR | ratio 95% CI "
        "| bandwidth limit ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['context_len']} | {r['width']} | {r['step_ms']:.2f} | "
            f"{r['step_ms_iqr'][0]:.2f}-{r['step_ms_iqr'][1]:.2f} | {_ratio_cells(r['ratio'])} | "
            f"{limit_ms:.2f} |"
        )
    return "\n".join(lines + load_warnings(results))


def load_warnings(results: list[dict]) -> list[str]:
    """A line per shape that ran beside others' work: its numbers are not an idle machine's."""
    out = []
    for r in results:
        load = r.get("load")
        if r["width"] != 1 or not load:
            continue
        if load["others_busy_pct"] > BUSY_WARN_PCT or load["steal_pct"] > STEAL_WARN_PCT:
            out.append(f"warning: batch {r['batch']}, context {r['context_len']}: other "
                       f"processes ran {load['others_busy_pct']:.1f}% and the hypervisor took "
                       f"{load['steal_pct']:.1f}% of the CPUs' time: not an idle machine, "
                       f"rerun before comparing")
    return out


def _ratio_cells(ratio: dict | None) -> str:
    if ratio is None:
        return " | | "
    ci = "" if ratio["ci_lo"] is None else f"{ratio['ci_lo']:.3f}-{ratio['ci_hi']:.3f}"
    return f"{ratio['median']:.3f} | {ratio['q1']:.3f}-{ratio['q3']:.3f} | {ci}"
