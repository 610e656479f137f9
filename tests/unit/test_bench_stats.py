"""bench statistics, the A/B alternation, closed-loop concurrency, identity checks, peer arms.

No model is loaded: arms and engines are fakes that record what they are asked to do.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy import stats as st

from dynaspec.bench.compare import EngineArm, IdentityViolation, RunRecord, run_pairs
from dynaspec.bench.compare_report import build_report, markdown_report
from dynaspec.bench.stats import latency_summary, paired_ratio, percentile, run_order, t_quantile
from dynaspec.bench.workloads import WorkItem
from dynaspec.engine.step_recorder import StepTimes
from dynaspec.metrics.records import RequestStepSpec, StepStats
from dynaspec.metrics.stats import SpecCounters, fold_step
from dynaspec.outputs import RequestOutput, RequestTimings
from dynaspec.sampling_params import SamplingParams


# ---- statistics on known data ------------------------------------------------------------
def test_ratio_of_constant_pairs_has_a_zero_width_interval():
    est = paired_ratio([10, 20, 30, 40, 50], [20, 40, 60, 80, 100])
    assert est.ratio == pytest.approx(2.0)
    assert est.lo == pytest.approx(2.0) and est.hi == pytest.approx(2.0)


def test_ratio_ci_matches_hand_computed_t_interval():
    d = [0.1, 0.2, 0.3]  # log ratios: mean 0.2, sd 0.1, t(2, 0.975) = 4.302653
    a = [1.0, 2.0, 4.0]
    b = [x * math.exp(di) for x, di in zip(a, d)]
    est = paired_ratio(a, b)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)
    assert est.ratio == pytest.approx(math.exp(0.2))
    assert est.lo == pytest.approx(math.exp(0.2 - half), rel=1e-9)
    assert est.hi == pytest.approx(math.exp(0.2 + half), rel=1e-9)
    assert est.log_sd == pytest.approx(0.1)


def test_ratio_ci_agrees_with_scipy_one_sample_t_interval():
    rng = np.random.default_rng(0)
    a = rng.uniform(5, 10, 8)
    b = a * np.exp(rng.normal(0.3, 0.05, 8))
    est = paired_ratio(list(a), list(b), confidence=0.9)
    ci = st.ttest_1samp(np.log(b / a), 0.0).confidence_interval(0.9)
    assert math.log(est.lo) == pytest.approx(ci.low) and math.log(est.hi) == pytest.approx(ci.high)
    assert est.lo < est.ratio < est.hi


@pytest.mark.parametrize("df", [1, 2, 3, 4, 6, 9, 15, 30, 120, 1000])
@pytest.mark.parametrize("p", [0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.025, 1e-4])
def test_t_quantile_matches_scipy_without_needing_it(p, df):
    # The bench computes t quantiles itself so a base install (no scipy) can run it.
    assert t_quantile(p, df) == pytest.approx(float(st.t.ppf(p, df)), rel=1e-9, abs=1e-12)


def test_t_quantile_known_values_and_bad_input():
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736174698, rel=1e-9)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451051977987, rel=1e-9)
    assert t_quantile(0.025, 4) == -t_quantile(0.975, 4)
    for p, df in ((0.0, 3), (1.0, 3), (0.9, 0)):
        with pytest.raises(ValueError):
            t_quantile(p, df)


def test_ratio_with_one_pair_has_no_interval_and_bad_input_is_refused():
    est = paired_ratio([2.0], [3.0])
    assert est.ratio == pytest.approx(1.5) and est.lo is None and "no CI" in est.fmt()
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratio([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        paired_ratio([], [])


def test_percentiles():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([], 50) is None
    s = latency_summary([0.1, 0.2, 0.3])
    assert s["p50"] == pytest.approx(0.2) and s["n"] == 3 and s["mean"] == pytest.approx(0.2)


def test_run_order_alternates_and_abba_counterbalances():
    assert run_order(3) == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert [a for _, a in run_order(2, scheme="abba")] == ["a", "b", "b", "a"]
    assert [a for _, a in run_order(1, ("a", "b", "hf"))] == ["a", "b", "hf"]
    with pytest.raises(ValueError):
        run_order(0)


# ---- alternation with mock arms and a mock clock ------------------------------------------
class MockArm:
    """Records every call in a shared log; its 'time' is a fixed number of seconds per run."""

    def __init__(self, name, log, seconds, tokens=100, violations=()):
        self.label, self.name, self.log, self.seconds = f"mock-{name}", name, log, seconds
        self.tokens, self.violations = tokens, list(violations)

    def run(self, items, params, concurrency, tag):
        self.log.append((self.name, tag, id(items), id(params), concurrency))
        rec = RunRecord(
            self.name,
            -1,
            self.tokens,
            self.seconds.pop(0) if isinstance(self.seconds, list) else self.seconds,
        )
        rec.outputs = [[1, 2, 3] for _ in items]
        rec.identity_violations = list(self.violations)
        return rec

    def describe(self):
        return {"kind": "mock", "label": self.label}


def _items(n=3):
    return [WorkItem([1, 2, 3], 8, f"w{i}") for i in range(n)]


def test_pairs_alternate_a_b_with_the_same_prompts_and_params():
    log = []
    arms = {
        "a": MockArm("a", log, [1.0, 1.0, 1.0, 1.0, 1.0]),
        "b": MockArm("b", log, [0.5, 0.5, 0.5, 0.5, 0.5]),
    }
    items, params = _items(), [SamplingParams(max_tokens=8)] * 3
    recs = run_pairs(arms, items, params, concurrency=4, pairs=5)
    assert [e[0] for e in log] == ["a", "b"] * 5
    assert [(r.arm, r.pair) for r in recs] == [(a, p) for p in range(5) for a in "ab"]
    assert {e[2] for e in log} == {id(items)} and {e[3] for e in log} == {id(params)}
    assert {e[4] for e in log} == {4}
    report = build_report(arms, recs, {"concurrency": 4}, bandwidth=None)
    assert report["ratio"] == pytest.approx(2.0) and report["ci95"] == [pytest.approx(2.0)] * 2
    assert report["a"]["tokens_per_s"] == [100.0] * 5 and report["b"]["tokens_per_s"] == [200.0] * 5
    assert report["ratios"]["b"]["outputs_vs_a"] == {"identical": 15, "total": 15}


def test_identity_violation_stops_the_benchmark_loudly():
    log = []
    arms = {
        "a": MockArm("a", log, 1.0),
        "b": MockArm("b", log, 1.0, violations=["sum(accepted_per_pos) != x"]),
    }
    with pytest.raises(IdentityViolation, match="arm b .*pair 0"):
        run_pairs(arms, _items(), [SamplingParams()] * 3, 1, 5)
    assert [e[0] for e in log] == ["a", "b"]


def test_markdown_and_bandwidth_limit():
    log = []
    arms = {"a": MockArm("a", log, 2.0), "b": MockArm("b", log, 1.0)}
    recs = run_pairs(arms, _items(), [SamplingParams()] * 3, 2, 5)
    settings = {"workload": "chat", "num_prompts": 3, "max_tokens": 8, "concurrency": 2, "pairs": 5,
                "order": "alternate", "temperature": 0.0}
    report = build_report(arms, recs, settings, bandwidth=1e9)
    md = markdown_report(report, ["a", "b"])
    assert "| b/a | 2.000x | [2.000, 2.000] | 15/15 |" in md


# ---- closed loop on a fake engine ---------------------------------------------------------
@dataclass
class FakeEngine:
    """Each request needs `steps_per_req` steps, one token each; counters fold like the real
    engine's unless `honest` is False (then the books do not balance)."""

    steps_per_req: int = 3
    honest: bool = True
    counters: SpecCounters = field(default_factory=SpecCounters)
    times: StepTimes = field(default_factory=StepTimes)
    live: dict = field(default_factory=dict)
    max_live: int = 0
    finished_times: list = field(default_factory=list)

    def take_finished_times(self):
        times, self.finished_times = self.finished_times, []
        return times

    def __post_init__(self):
        self.scheduler = type("S", (), {"num_preemptions": 0})()
        self.recorder = type("R", (), {"execution_steps": {}})()  # steps by path: none

    def add_request(self, prompt, params, request_id=None):
        self.live[request_id] = []
        self.max_live = max(self.max_live, len(self.live))
        return request_id

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs, specs = [], []
        for rid, toks in list(self.live.items()):
            toks.append(7)
            done = len(toks) == self.steps_per_req
            outs.append(
                RequestOutput(
                    rid,
                    [1],
                    list(toks),
                    [7],
                    finished=done,
                    timings=RequestTimings(0.01, 0.03, (0.01,)) if done else None,
                )
            )
            specs.append(RequestStepSpec(rid, 0, 0, 1, None))
            if done:
                del self.live[rid]
        if self.honest:
            self.counters = fold_step(self.counters, StepStats(k=None, requests=tuple(specs)))
        self.times.steps += 1
        return outs


def test_closed_loop_keeps_exactly_c_in_flight():
    eng = FakeEngine()
    arm = EngineArm("fake", {}, engine=eng)
    rec = arm.run(_items(7), [SamplingParams()] * 7, concurrency=3, tag="a-p0")
    assert eng.max_live == 3 and rec.tokens == 21 and rec.identity_violations == []
    assert rec.outputs == [[7, 7, 7]] * 7 and len(rec.ttft_s) == 7
    assert rec.census["steps"] == rec.phase_s["steps"] == 9  # ceil(7/3) waves of 3 steps


def test_each_arm_runs_with_the_torch_threads_it_was_built_with():
    """An async arm's constructor leaves the main thread at 1 torch thread; a sync arm built
    before it must still run its steps on its own count."""
    import torch

    class CountingEngine(FakeEngine):
        def step(self):
            self.seen = torch.get_num_threads()
            return super().step()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        sync = EngineArm("sync", {}, engine=CountingEngine())
        torch.set_num_threads(1)  # what building the pipelined arm leaves behind
        pipelined = EngineArm("async", {}, engine=CountingEngine())
        sync.run(_items(1), [SamplingParams()], concurrency=1, tag="a-p0")
        assert sync.engine.seen == 2
        pipelined.run(_items(1), [SamplingParams()], concurrency=1, tag="b-p0")
        assert pipelined.engine.seen == 1
    finally:
        torch.set_num_threads(before)


def test_engine_arm_reports_unbalanced_counters():
    arm = EngineArm("fake", {}, engine=FakeEngine(honest=False))
    rec = arm.run(_items(2), [SamplingParams()] * 2, concurrency=1, tag="b-p0")
    assert any("engine counted 0 emitted" in v for v in rec.identity_violations)


# ---- peers --------------------------------------------------------------------------------
def test_peer_spec_parsing():
    from dynaspec.bench.peers import parse_peer_spec, peer_arm_specs
    assert parse_peer_spec("peer:hf:lookup,k=3") == ("hf", "lookup", {"k": "3"})
    with pytest.raises(ValueError, match="unknown peer"):
        parse_peer_spec("peer:tgi:plain")
    with pytest.raises(ValueError):
        parse_peer_spec("hf:plain")
    assert peer_arm_specs("vllm") == ["peer:vllm:plain", "peer:vllm:ngram"]
    assert peer_arm_specs("hf", "/d")[-1] == "peer:hf:assistant,draft=/d"


def test_vllm_peer_without_vllm_is_skipped_with_a_message(tmp_path, monkeypatch):
    from dynaspec.bench import peer_vllm, peers
    monkeypatch.setattr(peer_vllm, "model_path", lambda opts: (str(tmp_path), "hf"))
    with pytest.raises(peers.PeerUnavailable, match="needs the interpreter"):
        peers.make_peer_arm("peer:vllm:plain", 1)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    if _importable("vllm"):
        pytest.skip("vllm is installed in this interpreter")
    with pytest.raises(peers.PeerUnavailable, match="cannot import vllm"):
        peers.make_peer_arm("peer:vllm:plain", 1, defaults={"python": sys.executable})


def _importable(mod):
    import importlib.util
    return importlib.util.find_spec(mod) is not None


_FAKE_VLLM = """
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, max_tokens, temperature, seed, ignore_eos):
        self.max_tokens = max_tokens
class _Out:
    def __init__(self, ids): self.token_ids = ids
class _Req:
    def __init__(self, ids): self.outputs, self.metrics = [_Out(ids)], None
class LLM:
    def __init__(self, **kw): print("vllm log line on stdout")
    def generate(self, prompts, sps, use_tqdm=False):
        return [_Req(list(p["prompt_token_ids"][:1]) * sp.max_tokens) for p, sp in zip(prompts,
        sps)]
"""


def test_vllm_peer_protocol_with_a_fake_vllm(tmp_path, monkeypatch):
    from dynaspec.bench import peer_vllm, peers
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(_FAKE_VLLM))
    (pkg / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(peer_vllm, "model_path", lambda opts: (str(tmp_path), "hf"))
    arm = peers.make_peer_arm("peer:vllm:ngram,k=3", 2, defaults={"python": sys.executable})
    try:
        rec = arm.run(_items(2), [SamplingParams(max_tokens=4)] * 2, 2, "c-p0")
    finally:
        arm.close()
    assert rec.outputs == [[1, 1, 1, 1]] * 2 and rec.tokens == 8 and arm.version == "0.0-fake"


def test_llamacpp_peer_skips_cleanly_when_absent():
    from dynaspec.bench import peers
    if _importable("llama_cpp"):
        pytest.skip("llama-cpp-python is installed")
    with pytest.raises(peers.PeerUnavailable, match="llama-cpp-python"):
        peers.make_peer_arm("peer:llamacpp:plain", 1)
