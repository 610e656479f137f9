"""`dynaspec bench decode`: steady-state decode speed beside this machine's bandwidth limit.

The limit is (weight bytes one decode step reads) / (measured read bandwidth): a batch-b decode
step cannot beat it on a machine that must stream every weight once per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from dynaspec.engine.llm_engine import LLMEngine, StepTimes
from dynaspec.models.quant_linear import cpu_info
from dynaspec.sampling_params import SamplingParams


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


def run_decode(engine: LLMEngine, batch: int, prompt_len: int, gen_tokens: int) -> dict:
    """Prefill `batch` prompts, then time only the steps where every request decodes."""
    vocab = engine.parts.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(100, vocab - 100, (prompt_len,), generator=g).tolist()
        engine.add_request(ids, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    engine.times = StepTimes()
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    t = engine.times
    split = {k: v / max(t.steps, 1) * 1e3 for k, v in asdict(t).items() if k != "steps"}
    step_ms = elapsed / max(t.steps, 1) * 1e3
    return {"batch": batch, "context": prompt_len, "tokens_per_s": tokens / elapsed, "step_ms": step_ms,
            "steps": t.steps, "phase_ms": split,
            "outside_forward_pct": 100 * (1 - split["forward"] / step_ms) if step_ms else 0.0}


def report(engine: LLMEngine, results: list[dict], bandwidth: float) -> str:
    wbytes = engine.parts.model.weight_bytes_per_step()
    limit_step_s = wbytes / bandwidth
    m = engine.parts.model
    lines = [f"model {engine.parts.model_name}, dtype {m.dtype}, quantization {m.weights.mode}, "
             f"attention {m.attn.name}, {torch.get_num_threads()} threads",
             f"CPU: {cpu_info().summary()}",
             f"weights read per step (kernel formats): {wbytes / 1e6:.1f} MB; read bandwidth "
             f"{bandwidth / 1e9:.1f} GB/s; bandwidth-limited step {limit_step_s * 1e3:.2f} ms",
             "| batch | context | tok/s | step ms | limit tok/s | % of limit | schedule | prepare | forward | sample | update | outside fwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        limit = r["batch"] / limit_step_s
        p = r["phase_ms"]
        lines.append(f"| {r['batch']} | {r['context']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {limit:.1f} | "
                     f"{100 * r['tokens_per_s'] / limit:.0f}% | {p['schedule']:.2f} | {p['prepare']:.2f} | "
                     f"{p['forward']:.2f} | {p['sample']:.2f} | {p['update']:.2f} | "
                     f"{r['outside_forward_pct']:.1f}% |")
    return "\n".join(lines)
