"""One time-boxed device run (scripts/gpu_check.sh): every stage in its own subprocess with a
deadline, the report rewritten after each stage, so a crash or a timeout still returns what
finished. `python -m dynaspec.bench.gpu_check run --out REPORT.json --budget SECONDS`.

Stages, in order (the HF compile arm last-but-one, the real model last):
  env       torch/triton/transformers, the GPU, HBM copy bandwidth, launch cost (eager, graph)
  tests     pytest -m cuda tests/cuda
  model     a random-weight model of SmolLM2-135M's exact shape, bf16 (tiny under DRY_RUN)
  ours      bench decode with default flags (graphs by default on CUDA), batch 1/16/64, phase
            times, kernels per step, launch-bound floor; graph vs eager at batch 1; the
            whole-step graph's time per verify width at batch 1, ctx 128
  hf        HF generate, static cache, no compile, same model and batches
  hf_compile  HF generate, static cache + its compile (whatever fits the time left)
  real      MODEL_GGUF, code-edit prompts, plain vs n-gram at concurrency 1 and 64, default
            flags, greedy outputs compared

DRY_RUN=1 (or no GPU): tiny shapes on the CPU; GPU-only parts are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STAGES = ("env", "tests", "model", "ours", "hf", "hf_compile", "real")
# Seconds each stage may take at most (the overall budget is split in this order; the real
# model keeps its reserve so the HF compile arm cannot eat it).
CAPS = {"env": 20, "tests": 60, "model": 40, "ours": 55, "hf": 25, "hf_compile": 55, "real": 50}
RESERVE = {"real": 50}
# The model stage is CPU work (random init, save): it runs beside env and tests.
BACKGROUND = ("model",)


def _cap(name: str) -> float:
    """A stage's cap; GPU_CHECK_SCALE stretches every cap (CPU dry runs on a loaded machine)."""
    return CAPS[name] * float(os.environ.get("GPU_CHECK_SCALE", "1"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("DRY_RUN") != "1"


def _dev() -> str:
    return "cuda" if _cuda() else "cpu"


def _batches() -> list[int]:
    return [1, 16, 64] if _cuda() else [1, 4]


def _gen() -> int:
    return 64 if _cuda() else 8


def _model_dir() -> str:
    return os.environ.get("GPU_CHECK_WORK", "/tmp/dynaspec_gpu_check") + "/smollm2_shape"


# ---- stages (each runs in its own process and returns a JSON-able dict) ----

def stage_env() -> dict:
    import torch

    r: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
               "dry_run": os.environ.get("DRY_RUN") == "1", "python": sys.version.split()[0]}
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("triton", "transformers", "gguf"):
        try:
            r[mod] = version(mod)
        except PackageNotFoundError:
            r[mod] = None
    if _cuda():
        from dynaspec.bench.decode import measure_device_bandwidth, measure_launch_cost

        dev = torch.device("cuda")
        r["device"] = torch.cuda.get_device_name(0)
        r["hbm_copy_GBps"] = measure_device_bandwidth(dev) / 1e9
        r["launch"] = measure_launch_cost(dev)
    else:
        r["note"] = "no GPU (or DRY_RUN): bandwidth and launch cost skipped"
    return r


def stage_tests() -> dict:
    env = dict(os.environ)
    if not _cuda():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/cuda", "-rs",
           "-p", "no:cacheprovider"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=_cap("tests") - 5)
    tail = (p.stdout + p.stderr)[-3000:]
    return {"rc": p.returncode, "summary": tail.strip().splitlines()[-1] if tail else "",
            "tail": tail}


def stage_model() -> dict:
    """mkmodel: LlamaForCausalLM of SmolLM2-135M's shape, random bf16 weights, a word-level
    tokenizer covering the vocab (speed needs no real text)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = not _cuda()
    out = _model_dir()
    os.makedirs(out, exist_ok=True)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64 if tiny else 576,
                      intermediate_size=128 if tiny else 1536,
                      num_hidden_layers=2 if tiny else 30, num_attention_heads=2 if tiny else 9,
                      num_key_value_heads=1 if tiny else 3, max_position_embeddings=8192,
                      # transformers 5 takes rope_theta through **kwargs (into rope_parameters,
                      # which 4.x does not know); its typed signature leaves it out.
                      rope_theta=100000.0,  # type: ignore[call-arg]
                      tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    # transformers types the decorated .to() with the model as its first argument.
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2"}, f)
    return {"dir": out, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}


def _engine(model: str, **kw):
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=model, device=_dev(), **kw))


def stage_ours(deadline: float, path: str) -> dict:
    """Each part's result is saved as it lands; a part that fails is recorded, the rest run."""
    import torch

    from dynaspec.bench.decode import kernels_per_step, measure_launch_cost, run_decode
    from dynaspec.spec_decode.policy.cost_profile import synthetic_step

    r: dict = {}

    def part(key: str, fn) -> None:
        if time.time() > deadline:
            r[key] = {"skipped": "stage time box"}
        else:
            try:
                r[key] = fn()
            except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
                r[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        with open(path, "w") as f:
            json.dump(r, f, default=str)
        print("ours", key, str(r[key])[:300], flush=True)

    # precompile: every grid shape captured at start-up, so no capture lands inside a timing
    eng = _engine(_model_dir(), dtype="bfloat16", precompile=True)
    p = eng.parts
    ex = p.runner.executor
    r["attention"] = p.model.attn.name
    r["execution"] = {f"{b}x{w}": p.exec_plan.path_for(b, w)[0] for b, w in p.exec_plan.grid}
    run_decode(eng, 1, 64, 8)  # warm-up: Triton compiles
    part("graphs", lambda: [run_decode(eng, b, 64, _gen()) for b in _batches()])
    r["build_seconds"] = {f"{k[0]}x{k[1]}": v for k, v in ex.build_seconds.items()} if ex else {}
    r["broken_shapes"] = {f"{k[0]}x{k[1]}": v for k, v in ex.errors.items()} if ex else {}
    if _cuda():
        def verify() -> dict:
            ms = _verify_widths(p, (1, 2, 3, 5, 9), ctx=128)
            return {"graph_ms": ms, "ratio_to_width_1": {w: t / ms["1"] for w, t in ms.items()}}

        def floor() -> dict:
            step = synthetic_step(p.model, p.runner.kv_caches, p.kv.block_size,
                                  p.kv.num_blocks, 1, 128, 1)
            step()
            n = kernels_per_step(step)
            launch = measure_launch_cost(p.model.device)
            return {"kernels_per_step_b1": n, "launch": launch,
                    "launch_bound_floor_ms": n * launch["graph_s"] * 1e3}

        part("verify_b1_ctx128", verify)
        part("launch_floor", floor)
    eng = p = ex = None  # the graph engine's memory goes before the eager one loads
    if _cuda():
        torch.cuda.empty_cache()

    def eager_b1() -> dict:
        eager = _engine(_model_dir(), dtype="bfloat16", execution="eager")
        run_decode(eager, 1, 64, 8)
        got = run_decode(eager, 1, 64, _gen())
        g1 = r["graphs"][0]["step_ms"] if isinstance(r.get("graphs"), list) else None
        return {**got, "eager_over_graph": got["step_ms"] / g1 if g1 else None}

    part("eager_b1", eager_b1)
    return r


def _verify_widths(parts, widths, ctx: int) -> dict:
    """Device time of the whole-step graph (body, head, argmax) at batch 1, per width: median
    of 30 replays timed with CUDA events. Runs after every request finished (it writes the KV
    of the first blocks, which no request owns any more)."""
    import statistics

    import torch

    from dynaspec.attention.backend import AttentionBatch

    runner, out = parts.runner, {}
    ex, bs = runner.executor, runner.block_size
    for w in widths:
        c = ctx + w
        table = list(range(-(-c // bs)))
        ab = AttentionBatch([w], [c], [table], bs, runner.device, 1, w, runner.buffers.attn)
        md = ex.backend.build_metadata(ab)
        ids = runner.buffers.input_ids[:w]
        ex.run(ids, None, md)  # capture
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ex.run(ids, None, md)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        out[str(w)] = statistics.median(times)
    return out


def _hf(arms: tuple[str, ...], deadline: float, path: str, repeats: int) -> dict:
    from dynaspec.bench.hf_peer import load_hf, run_arm

    model = load_hf(_model_dir(), _dev())
    got: list = []
    for arm in arms:  # batch 1 first, then the largest: the order of what matters most
        for b in sorted(_batches(), key=lambda x: (x != 1, -x)):
            if time.time() > deadline:
                got.append({"arm": arm, "batch": b, "skipped": "stage time box"})
                continue
            try:
                got.append(run_arm(model, arm, b, 64, _gen(), repeats=repeats))
            except Exception as exc:  # noqa: BLE001 - reported
                got.append({"arm": arm, "batch": b, "error": f"{type(exc).__name__}: {exc}"[:300]})
            with open(path, "w") as f:  # partial results survive a kill
                json.dump({"results": got}, f)
            print("hf", got[-1], flush=True)
    return {"results": got}


def stage_hf(deadline: float, path: str) -> dict:
    return _hf(("static",), deadline, path, repeats=1)


def stage_hf_compile(deadline: float, path: str) -> dict:
    if not _cuda():
        return {"skipped": "no GPU: torch.compile of HF generate is measured on the device only"}
    return _hf(("static_compile",), deadline, path, repeats=2)


def stage_real(deadline: float, path: str) -> dict:
    gguf = os.environ.get("MODEL_GGUF")
    if not gguf or not os.path.exists(gguf):
        return {"skipped": f"MODEL_GGUF not set or missing ({gguf!r})"}
    from dynaspec.bench.workloads import load_workload
    from dynaspec.engine.sync_driver import generate
    from dynaspec.sampling_params import SamplingParams

    r: dict = {}
    new = 128 if _cuda() else 8
    conc = [1, 64] if _cuda() else [1, 2]
    outs: dict = {}
    for arm, kw in (("plain", {}), ("ngram", {"speculator": "ngram", "num_spec_tokens": 4})):
        eng = _engine(gguf, precompile=True, **kw)  # captures at start-up, not in timings
        try:
            items = load_workload("code_edit", eng.tokenizer, max(conc), seed=0)
        except Exception as exc:  # noqa: BLE001 - e.g. no stdlib sources on the image
            return {**r, "error": f"code_edit workload unavailable: {exc}"[:300]}
        keep = eng.max_model_len - new - 8  # only a tiny dry-run model is this short
        ids = [it.prompt_ids[-keep:] for it in items]
        sp = SamplingParams(temperature=0.0, max_tokens=new)
        # Warm-up outside the timing: Triton compiles and the small shapes' graph captures
        # would otherwise land on whichever arm runs first.
        generate(eng, ids[:2], [SamplingParams(temperature=0.0, max_tokens=8)] * 2)
        for c in conc:
            if time.time() > deadline:
                r[f"{arm}_c{c}"] = {"skipped": "stage time box"}
                continue
            prompts = ids[: max(c, 2)]
            t0, toks, got = time.perf_counter(), 0, []
            for i in range(0, len(prompts), c):  # concurrency c: c requests at a time
                res = generate(eng, prompts[i:i + c], [sp] * len(prompts[i:i + c]))
                got += [o.token_ids for o in res]
                toks += sum(len(o.token_ids) for o in res)
            dt = time.perf_counter() - t0
            cnt = eng.counters
            r[f"{arm}_c{c}"] = {"tokens_per_s": toks / dt, "tokens": toks, "seconds": dt,
                                "drafts": getattr(cnt, "num_draft_tokens", None),
                                "accepted": getattr(cnt, "num_accepted_tokens", None)}
            outs[(arm, c)] = got
            with open(path, "w") as f:
                json.dump(r, f)
            print("real", arm, c, r[f"{arm}_c{c}"], flush=True)
        r[f"{arm}_execution"] = {f"{b}x{w}": eng.parts.exec_plan.path_for(b, w)[0]
                                 for b, w in eng.parts.exec_plan.grid}
        r[f"{arm}_policy"] = eng.parts.policy_info.describe() \
            if eng.parts.policy_info is not None else None
        del eng
    for c in conc:
        if ("plain", c) in outs and ("ngram", c) in outs:
            a, b = outs[("plain", c)], outs[("ngram", c)]
            r[f"greedy_identical_c{c}"] = sum(x == y for x, y in zip(a, b)) == len(a)
            r[f"ngram_over_plain_c{c}"] = r[f"ngram_c{c}"]["tokens_per_s"] / \
                r[f"plain_c{c}"]["tokens_per_s"]
    return r


# ---- the driver ----

def _start_stage(name: str, cap: float, out_dir: str):
    part = os.path.join(out_dir, f".stage_{name}.json")
    cmd = [sys.executable, "-m", "dynaspec.bench.gpu_check", "stage", name, "--out", part,
           "--deadline", str(time.time() + cap - 8)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p, part, time.time(), cap


def _finish_stage(p, part: str, t0: float, cap: float) -> dict:
    try:
        out, _ = p.communicate(timeout=max(1.0, t0 + cap - time.time()))
        res = {"rc": p.returncode, "log_tail": (out or "")[-1500:]}
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        res = {"rc": "timeout", "log_tail": (out or "")[-1500:]}
    if os.path.isfile(part):
        with open(part) as f:
            res["result"] = json.load(f)
        os.remove(part)
    res["seconds"] = round(time.time() - t0, 1)
    return res


def run_all(out: str, budget: float) -> dict:
    start = time.time()
    end = start + budget
    report: dict = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
                    "budget_s": budget, "stages": {}}
    out_dir = os.path.dirname(os.path.abspath(out))
    bg = {name: _start_stage(name, _cap(name), out_dir) for name in BACKGROUND}
    for name in STAGES:
        if name in bg:
            report["stages"][name] = _finish_stage(*bg[name])
            print(f"[gpu_check] {name}: rc {report['stages'][name]['rc']} (background)",
                  flush=True)
            continue
        reserve = sum(v for k, v in RESERVE.items() if STAGES.index(k) > STAGES.index(name))
        cap = min(_cap(name), end - time.time() - reserve)
        if cap < 10:
            report["stages"][name] = {"skipped": f"{cap:.0f} s left for it"}
        else:
            print(f"[gpu_check] stage {name} (cap {cap:.0f} s)", flush=True)
            report["stages"][name] = _finish_stage(*_start_stage(name, cap, out_dir))
            print(f"[gpu_check] {name}: rc {report['stages'][name]['rc']} in "
                  f"{report['stages'][name]['seconds']} s", flush=True)
        report["elapsed_s"] = round(time.time() - start, 1)
        with open(out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    from dynaspec.bench.gpu_report import summary

    print(summary(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--budget", type=float, default=260.0)
    s = sub.add_parser("stage")
    s.add_argument("name", choices=STAGES)
    s.add_argument("--out", required=True)
    s.add_argument("--deadline", type=float, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run_all(args.out, args.budget)
        return 0
    fn = globals()[f"stage_{args.name}"]
    timed = ("ours", "hf", "hf_compile", "real")
    res = fn(args.deadline, args.out) if args.name in timed else fn()
    with open(args.out, "w") as f:
        json.dump(res, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
