"""The execution plan end to end: the width is planned by schedule(), fixed-shape steps are
padded and run the compiled path, and compiled output equals eager output.

Engine-semantics tests compile with torch.compile's aot_eager backend (the same traced
fixed-shape graph without inductor's code generation: seconds, not minutes, on a loaded
machine); the exactness test compiles with inductor, the real path, on two shapes per width.
"""

from __future__ import annotations

import json
import shutil

import pytest

from dynaspec import LLM

from .conftest import assert_greedy_equal, greedy, random_prompts, watch_steps

SEED_SCHEDULE = "[[1, 8, 5], [9, 16, 4]]"
FAST = dict(execution="compiled", compile_backend="aot_eager")


def _decode_only(out) -> bool:
    return all(s.sampling and s.num_new_tokens == 1 for s in out.scheduled)


def test_seed_case_every_decode_step_is_width_4_and_compiled(tiny_llama_dir, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              num_spec_tokens=3, k_schedule=SEED_SCHEDULE, prompt_lookup_min=2,
              prompt_lookup_max=3, max_num_seqs=4, **FAST)
    check_integrity(llm.engine)
    assert (llm.engine.plan.kind, llm.engine.plan.max_k) == ("constant", 3)
    assert llm.engine.exec_plan.grid == ((1, 4), (2, 4), (4, 4))
    prompts = random_prompts(4, 280, seed=5, lo=8, hi=30, repetitive=True)
    prompts.append(list(range(10, 43)))  # no repeated 2-gram: n-gram finds no match
    llm.generate(prompts, greedy(10, ignore_eos=True))
    seen = watch_steps(llm)
    before = llm.engine.counters
    llm.generate([prompts[-1]], greedy(6, ignore_eos=True))  # prefix hit: first decode padded
    llm.generate(prompts[:3], greedy(10, ignore_eos=True))
    decode_steps = [(o, r) for o, r in seen if _decode_only(o)]
    assert decode_steps, "the workload must have decode-only steps"
    for out, res in decode_steps:
        assert out.batch.width == 4 and res.batch.path == "compiled"
        assert out.batch.num_reqs_padded in (1, 2, 4) and out.batch.num_reqs_padded >= out.num_reqs
        for r in res.results:
            assert r.num_draft_tokens + r.num_padding_tokens == 3
    for out, res in seen:
        if not _decode_only(out):
            assert out.batch.width is None and res.batch.path == "eager"
    hit_out, hit_res = seen[1]  # seen[0] is the hit request's single-token catch-up step
    assert hit_out.scheduled[0].request.num_cached_tokens == 32 and _decode_only(hit_out)
    assert hit_res.results[0].num_padding_tokens == 3, "no match at the prefix-hit first decode"
    delta = llm.engine.counters - before
    n_compiled = sum(1 for _, r in seen if r.batch.path == "compiled")
    assert n_compiled == len(decode_steps)
    assert llm.engine.recorder.execution_steps[("compiled", "4")] >= n_compiled
    # Padding is invalid{padding}, never drafts: the counters equal the real drafts verified.
    pads = sum(r.num_padding_tokens for _, res in seen for r in res.results)
    real = sum(r.num_draft_tokens for _, res in seen for r in res.results)
    assert pads > 0 and delta.invalid_draft_tokens.get("padding") == pads
    assert delta.num_draft_tokens == real and sum(delta.drafted_per_pos) == real
    assert delta.num_accepted_tokens <= real
    assert llm.engine.counters.check_identities() == []


def test_variable_plan_steps_use_a_width_of_the_plan(tiny_llama_dir, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              k_schedule="[[1, 1, 3], [2, 4, 1]]", prompt_lookup_min=1, max_num_seqs=4, **FAST)
    check_integrity(llm.engine)
    plan = llm.engine.plan
    assert plan.kind == "variable" and plan.widths == (2, 4)
    assert llm.engine.exec_plan.grid == ((1, 4), (2, 2), (4, 2))
    seen = watch_steps(llm)
    prompts = random_prompts(3, 280, seed=2, lo=6, hi=20, repetitive=True)
    llm.generate(prompts, greedy(12, ignore_eos=True))
    llm.generate(prompts[:1], greedy(6, ignore_eos=True))  # alone: the batch-1 row, K 3
    widths = set()
    for out, res in seen:
        if _decode_only(out):
            assert out.batch.width in plan.widths
            assert out.batch.width == 1 + plan.k_for(out.num_reqs, 1)
            assert res.batch.path == "compiled"
            widths.add(out.batch.width)
    assert widths == {2, 4}, "both widths of the plan must run"


def test_always_zero_runs_width_1_without_a_drafter(tiny_llama_dir, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              k_schedule="[[1, 64, 0]]", max_num_seqs=2, precompile=True, **FAST)
    check_integrity(llm.engine)
    assert llm.engine.plan.kind == "always_zero" and llm.engine.runner.proposer is None
    assert llm.engine.exec_plan.grid == ((1, 1), (2, 1))
    assert set(llm.engine.runner.executor.build_seconds) == {(1, 1), (2, 1)}, "built at start-up"
    seen = watch_steps(llm)
    llm.generate(random_prompts(2, 280, seed=3, lo=5, hi=12), greedy(6, ignore_eos=True))
    decode = [(o, r) for o, r in seen if _decode_only(o)]
    assert decode and all(o.batch.width == 1 and r.batch.path == "compiled" for o, r in decode)
    assert all(r.num_padding_tokens == 0 for _, res in seen for r in res.results)


def test_draft_position_limit_clamps_the_plan(tiny_llama_dir, tmp_path, check_integrity):
    from dynaspec.cli.main import main

    short = tmp_path / "short_draft"
    shutil.copytree(tiny_llama_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 3  # a drafter that can never draft more than 2 tokens
    (short / "config.json").write_text(json.dumps(cfg))
    # table: the constant plan's clamp is under test (goodput would add width 1: variable)
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        k_policy="table",
        speculator="draft",
        draft_model=str(short),
        num_spec_tokens=4,
    )
    check_integrity(llm.engine)
    plan = llm.engine.plan
    assert (plan.kind, plan.max_k, plan.widths) == ("constant", 2, (3,))
    assert any("drafter limit 2" in c for c in plan.clamped)
    out = llm.generate([[5, 6, 7, 8]], greedy(4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    rc = main(["schedule", "explain", "--speculator", "draft", "--num-spec-tokens", "4",
               "--draft-model", str(short)])
    assert rc == 0


def test_explain_shows_draft_clamp_and_execution_rows(tiny_llama_dir, tmp_path, capsys):
    from dynaspec.cli.main import main

    short = tmp_path / "d"
    shutil.copytree(tiny_llama_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 3
    (short / "config.json").write_text(json.dumps(cfg))
    table = tmp_path / "k.json"
    table.write_text(SEED_SCHEDULE)
    adm = {"meta": {}, "entries": [
        {"num_reqs_padded": 1, "width": 3, "ratio": 0.7, "ci": [0.65, 0.75], "eager_ms": 10,
         "compiled_ms": 7},
        {"num_reqs_padded": 2, "width": 3, "ratio": 0.99, "ci": [0.9, 1.08], "eager_ms": 10,
         "compiled_ms": 9.9}]}
    (tmp_path / "k.admission.json").write_text(json.dumps(adm))
    assert (
        main(
            [
                "schedule",
                "explain",
                "--speculator",
                "draft",
                "--num-spec-tokens",
                "4",
                "--k-schedule",
                str(table),
                "--draft-model",
                str(short),
                "--max-num-seqs",
                "4",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "drafter limit 2" in text and "plan: constant(2)" in text
    rows = [
        line.split() for line in text.splitlines() if line.strip().startswith(("1 ", "2 ", "3-4 "))
    ]
    assert rows[0][:5] == ["1", "1", "2", "3", "compiled"] and "0.700" in " ".join(rows[0])
    assert rows[1][:5] == ["2", "2", "2", "3", "eager"], "a CI reaching 1 is not a win"
    assert rows[2][4] == "eager" and "unmeasured -> eager" in " ".join(rows[2])


def test_auto_runs_compiled_only_for_measured_winners(tiny_llama_dir, tmp_path, check_integrity):
    adm = tmp_path / "adm.json"
    adm.write_text(json.dumps({"meta": {}, "entries": [
        {"num_reqs_padded": 2, "width": 3, "ratio": 0.8, "ci": [0.7, 0.9], "eager_ms": 1,
         "compiled_ms": 0.8}]}))
    # table: every decode step at width 3, the one width the admission file measured
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        k_policy="table",
        speculator="ngram",
        num_spec_tokens=2,
        prompt_lookup_min=1,
        max_num_seqs=2,
        execution="auto",
        admission=str(adm),
        compile_backend="aot_eager",
    )
    check_integrity(llm.engine)
    seen = watch_steps(llm)
    llm.generate(
        random_prompts(2, 280, seed=4, lo=6, hi=14, repetitive=True), greedy(8, ignore_eos=True)
    )
    paths = {(o.num_reqs, r.batch.path) for o, r in seen if _decode_only(o)}
    assert (2, "compiled") in paths and (1, "compiled") not in paths
    assert all(r.batch.path == "eager" for o, r in seen if _decode_only(o) and o.num_reqs == 1)


def test_bench_admission_smoke(tiny_llama_dir, tmp_path):
    from dynaspec.cli.main import main

    out = tmp_path / "adm.json"
    rc = main(["bench", "admission", "--model", tiny_llama_dir, "--dtype", "float32",
               "--num-kv-blocks", "64", "--speculator", "ngram", "--num-spec-tokens", "2",
               "--max-num-seqs", "2", "--compile-backend", "aot_eager", "--ctx", "20",
               "--pairs", "2", "--steps", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(e["num_reqs_padded"], e["width"]) for e in data["entries"]] == [(1, 3), (2, 3)]
    assert all(e["winner"] in ("compiled", "eager") and e["ratio"] > 0 for e in data["entries"])
    assert set(data["meta"]["build_seconds"]) == {"1x3", "2x3"}


@pytest.mark.parametrize("spec", [{}, {"speculator": "ngram", "num_spec_tokens": 2,
                                       "prompt_lookup_min": 1},
                                  {"speculator": "draft", "num_spec_tokens": 2}],
                         ids=["no_spec", "ngram", "draft"])
def test_compiled_inductor_output_equals_eager(tiny_llama_dir, spec, check_integrity):
    if spec.get("speculator") == "draft":
        spec = {**spec, "draft_model": tiny_llama_dir}
    prompts = random_prompts(2, 280, seed=9, lo=6, hi=24, repetitive=True)
    # table: the full-width compiled path of a constant plan is under test
    base = dict(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_seqs=2,
        k_policy="table",
        enable_prefix_caching=False,
        **spec,
    )
    eager = LLM(**base, execution="eager")
    compiled = LLM(**base, execution="compiled")
    check_integrity(compiled.engine)
    params = greedy(10, ignore_eos=True)
    for batch in ([prompts[0]], prompts):  # alone, then batched
        ref = [o.token_ids for o in eager.generate(batch, params)]
        got = [o.token_ids for o in compiled.generate(batch, params)]
        for p, a, b in zip(batch, ref, got):
            assert_greedy_equal(tiny_llama_dir, p, a, b, f"compiled {spec or 'no spec'}")
    steps = compiled.engine.recorder.execution_steps
    width = str(1 + spec.get("num_spec_tokens", 0))
    assert steps[("compiled", width)] > 0 and not steps.get(("eager", width))
