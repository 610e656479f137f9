"""`dynaspec bench decode`: steady-state decode speed beside this machine's bandwidth limit.

The limit is (weight bytes one decode step reads) / (measured read bandwidth): a batch-b decode
step cannot beat it on a machine that must stream every weight once per step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch

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


def run_widths(engine: LLMEngine, batches: list[int], contexts: list[int], widths: list[int],
               rounds: int = 5, steps: int = 5) -> list[dict]:
    """Step time per (batch, context, width): the widths of one shape alternate within each round
    (A B C A B C ...) and each sample is the median of `steps` steps; the result is the median
    over rounds, with the ratio to width 1 in the same rounds."""
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
            for f in fns.values():
                f()  # warm-up: oneDNN primitives, caches
            samples: dict[int, list[float]] = {w: [] for w in widths}
            for _ in range(rounds):
                for w, f in fns.items():
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        f()
                        times.append(time.perf_counter() - t0)
                    samples[w].append(statistics.median(times) * 1e3)
            base = samples.get(1)
            for w in widths:
                ratios = [a / b_ for a, b_ in zip(samples[w], base)] if base else []
                out.append(
                    {
                        "batch": b,
                        "context_len": c,
                        "width": w,
                        "step_ms": statistics.median(samples[w]),
                        "ratio_to_width_1": statistics.median(ratios) if ratios else None,
                        "samples_ms": samples[w],
                    }
                )
    return out


def report_widths(engine: LLMEngine, results: list[dict], bandwidth: float) -> str:
    from dynaspec.models.quant_linear import linear_kernel_summary

    m = engine.parts.model
    wbytes = m.weight_bytes_per_step()
    limit_ms = wbytes / bandwidth * 1e3
    lines = [
        f"model {engine.parts.model_name}, {torch.get_num_threads()} threads, linear kernel "
        f"{linear_kernel_summary(m)}, attention {m.attn.name}",
        f"CPU: {cpu_info().summary()}",
        f"weights read per step: {wbytes / 1e6:.1f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"bandwidth-limited step {limit_ms:.2f} ms",
        "| batch | context | width | step ms | / width 1 | bandwidth limit ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = "" if r["ratio_to_width_1"] is None else f"{r['ratio_to_width_1']:.2f}"
        lines.append(
            f"| {r['batch']} | {r['context_len']} | {r['width']} | {r['step_ms']:.2f} | {ratio} | "
            f"{limit_ms:.2f} |"
        )
    return "\n".join(lines)
