"""The tuner's decision on synthetic cost models, the file it writes, and one tiny real timing."""

from __future__ import annotations

import json

import pytest

from dynaspec.bench import tune
from dynaspec.spec_decode.plan.plan import build_spec_plan


def memory_bound_cost(weights_s: float = 0.010, per_token_s: float = 0.001, draft_s: float = 0.0):
    """Step time = reading the weights once + compute per verified token (+ drafting): at batch 1
    a wider verify is nearly free, at batch 64 compute dominates and width costs linearly."""
    def fn(batch: int, ctx: int, k: int) -> float:
        return weights_s + batch * (1 + k) * per_token_s + batch * draft_s * (k > 0)
    return fn


ALPHA = [0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]


def test_buckets_cover_from_one_with_the_last_range_open():
    bs = tune.make_buckets([1, 4, 16, 64], [128, 2048])
    assert [b.batch for b in bs[::2]] == [(1, 2), (3, 8), (9, 32), (33, None)]
    assert [b.ctx for b in bs[:2]] == [(1, 512), (513, None)]
    assert all(
        b.batch[0] <= b.batch_at and (b.batch[1] is None or b.batch_at <= b.batch[1]) for b in bs
    )
    with pytest.raises(ValueError):
        tune.make_buckets([0, 4], [128])


def test_expected_tokens_uses_conditional_rates():
    assert tune.survival([0.5, 0.5]) == [0.5, 0.25]
    assert tune.expected_tokens([0.5, 0.5], 0) == 1.0
    assert tune.expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert tune.expected_tokens([0.5, 0.5], 4) == pytest.approx(1.75)  # unmeasured positions add 0


def test_tuner_speculates_at_small_batch_and_picks_zero_where_width_is_expensive():
    buckets = tune.make_buckets([1, 4, 16, 64], [128])
    choices = tune.choose_k(memory_bound_cost(), ALPHA, buckets, [0, 1, 2, 4, 8])
    by_batch = {c["batch_at"]: c for c in choices}
    assert by_batch[1]["k"] > 0 and by_batch[1]["gain"] > 2
    assert by_batch[64]["k"] == 0 and by_batch[64]["gain"] == 1.0
    g = by_batch[64]["goodput"]
    assert all(g[k] < g["0"] for k in ("1", "2", "4", "8"))  # speculation loses at every K there
    ks = [by_batch[b]["k"] for b in (1, 4, 16, 64)]
    assert ks == sorted(ks, reverse=True)  # cheaper width -> deeper speculation


def test_no_acceptance_or_expensive_drafting_gives_zero_everywhere():
    buckets = tune.make_buckets([1, 8], [64, 1024])
    assert {c["k"] for c in tune.choose_k(memory_bound_cost(), [0.0] * 8, buckets, [0, 2, 4])} == {
        0
    }
    costly = memory_bound_cost(draft_s=0.050)
    assert {c["k"] for c in tune.choose_k(costly, ALPHA, buckets, [0, 2, 4])} == {0}


def test_margin_keeps_zero_for_a_marginal_gain():
    def fn(batch, ctx, k):  # K=1 gains exactly 1% over K=0
        return 1.0 if k == 0 else 1.5 / 1.01
    (c,) = tune.choose_k(fn, [0.5], tune.make_buckets([1], [1]), [0, 1])
    assert c["k"] == 1
    (c,) = tune.choose_k(fn, [0.5], tune.make_buckets([1], [1]), [0, 1], margin=0.02)
    assert c["k"] == 0


def test_context_can_move_k():
    # Long contexts make a step KV-bound: the extra width is cheap next to the KV read.
    def fn(batch, ctx, k):
        return 0.01 + batch * ctx * 1e-6 + batch * (1 + k) * 0.004
    choices = tune.choose_k(fn, ALPHA, tune.make_buckets([16], [128, 8192]), [0, 2, 4])
    assert choices[0]["k"] == 0 and choices[1]["k"] > 0


def test_written_schedule_loads_as_a_plan_and_agrees_with_the_choices(tmp_path):
    buckets = tune.make_buckets([1, 4, 16, 64], [128, 2048])
    def fn(batch, ctx, k):
        return 0.010 + batch * ctx * 2e-7 + batch * (1 + k) * 0.0005
    choices = tune.choose_k(fn, ALPHA, buckets, [0, 1, 2, 4, 8])
    path = tmp_path / "schedule.json"
    obj = tune.write_schedule(choices, {"note": "synthetic"}, str(path))
    assert json.loads(path.read_text()) == obj and obj["measurements"]["note"] == "synthetic"
    plan = build_spec_plan("ngram", 0, str(path))
    assert plan.kind == "variable"
    for c in choices:
        b_lo, b_hi = c["batch"]
        c_lo, c_hi = c["ctx"]
        for b in (b_lo, c["batch_at"], b_hi or 4 * b_lo):
            for x in (c_lo, c["ctx_at"], c_hi or 4 * c_lo):
                assert plan.k_for(b, x) == c["k"], (b, x, c)
    assert build_spec_plan("ngram", 2, str(path)).max_k == 2  # --num-spec-tokens still clamps


def test_acceptance_from_counters_counts_no_match_as_an_opportunity():
    spec = {"num_spec_request_steps": 12, "draft_skips": {"prefill": 2, "no_match": 2},
            "accepted_per_pos": [6, 4, 2], "drafted_per_pos": [8, 8, 8]}
    alpha, e, n = tune.acceptance_from_spec(spec)
    assert n == 10 and e == [0.6, 0.4, 0.2]
    assert alpha == pytest.approx([0.6, 2 / 3, 0.5])
    assert 1 + sum(e) == pytest.approx(tune.expected_tokens(alpha, 3))


def test_time_step_runs_the_real_runner_at_full_width(tiny_llama_dir):
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine

    eng = LLMEngine(
        EngineConfig.from_kwargs(
            model=tiny_llama_dir,
            dtype="float32",
            speculator="ngram",
            num_spec_tokens=4,
            num_kv_blocks=64,
            enable_prefix_caching=False,
        )
    )
    times = tune.measure_step_times(eng, [1, 3], [40], [0, 4], repeats=1)
    assert set(times) == {(b, 40, k) for b in (1, 3) for k in (0, 4)}
    assert times[(3, 40, 4)]["min_drafted"] == 4 and times[(1, 40, 0)]["min_drafted"] == 0
    assert all(m["seconds"] > 0 for m in times.values())
    assert not eng.runner.generators  # synthetic requests are forgotten


def test_reprofile_refreshes_the_cached_cells(tiny_llama_dir, tmp_path, monkeypatch):
    """`dynaspec tune --reprofile` measures afresh and merges into the cache the engine reads.
    Whether this machine's timings pass the checks is not asserted (exit 1 says they did not);
    what is: a pass writes cells measured now, a refusal writes nothing."""
    import time

    from dynaspec.cli.main import build_parser
    from dynaspec.cli.tune_cmd import run_tune_cmd
    from dynaspec.spec_decode.policy import cost_cache
    from dynaspec.spec_decode.policy.cost_model import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    argv = ["tune", "--model", tiny_llama_dir, "--dtype", "float32", "--speculator", "ngram",
            "--num-spec-tokens", "2", "--max-num-seqs", "2", "--num-kv-blocks", "64"]
    with pytest.raises(ValueError, match="--out"):
        run_tune_cmd(build_parser().parse_args(argv))
    t0 = time.time()
    code = run_tune_cmd(build_parser().parse_args(argv + ["--reprofile"]))
    files = list((tmp_path / "cost").glob("*.json"))
    if code == 0:
        (path,) = files
        cells = cost_cache.load_cells(path.stem)
        assert cells and all(c.measured_at >= t0 and c.reps > 0 for c in cells.values())
    else:
        assert code == 1 and not files
