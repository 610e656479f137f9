"""Everything composes (docs/design.md §9): request parameters x drafters x chain/tree x
sync/async/DP 2, the cells of tests/composition_cases.py, on tiny random fp32 checkpoints.

- greedy: every request parameter (tests/composition_cases.GREEDY_PARAMETERS) in one batch per
  cell; text, token ids, finish reason and logprobs (within 1e-5) equal to the same batch with
  speculation off. The penalty requests accept drafts, and their penalties change the output,
  so equality shows the penalty state moved after every accepted token, not once per step;
- sampled: on an 8-token vocabulary, the first two tokens' joint distribution under the
  sampling parameters equals speculation off (chi-square, seeded); the test's power is checked
  by rejecting a deliberately wrong distribution;
- every refused cell is refused at start-up with a message naming both parts.
"""

from __future__ import annotations

import re

import pytest
from scipy.stats import chi2_contingency

from dynaspec import LLM, SamplingParams
from dynaspec.structured_params import StructuredOutputParams
from tests.composition_cases import README, cells, cli_flags, readme_table, render_table
from tests.e2e.dp_helpers import assert_processes_gone
from tests.e2e.test_spec_sampling import _tiny_vocab_model
from tests.e2e.test_tree_spec import _branching_prompts
from tests.model.tiny_eagle import write_eagle1

from .conftest import random_prompts

LOGPROB_TOL = 1e-5
MAX_TOKENS = 14
SEEDS = 160  # sampled requests per parameter set
P_MIN = 0.001  # 32 seeded tests: a false alarm at 0.01 is likely somewhere (seen: p=0.008)
RUN = [c for c in cells() if c.run and not (c.drafter == "none" and c.driver == "sync")]
REFUSED = [c for c in cells() if c.refused is not None]
SAMPLED = [c for c in cells() if c.sampled and c.drafter != "none"]


# ---- fixtures: checkpoints, drafters' files, prompts, the reference runs ---------------------
@pytest.fixture(scope="module")
def files(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("matrix")
    return {"model": tiny_llama_dir, "draft": tiny_llama_dir,
            "eagle": write_eagle1(str(d / "eagle"), copy=True),
            "engine": dict(dtype="float32", num_kv_blocks=256)}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An 8-token model (sampled checks), its draft model and an EAGLE head for it."""
    d = tmp_path_factory.mktemp("matrix_small")
    return {"model": _tiny_vocab_model(str(d / "t"), 0),
            "draft": _tiny_vocab_model(str(d / "d"), 1),
            "eagle": write_eagle1(str(d / "e"), hidden=32, heads=2, kv_heads=1, inter=64,
                                  vocab=8, seed=3, scale=0.5),
            # the whole sampled batch in one wave: fewer, wider steps
            "engine": dict(dtype="float32", num_kv_blocks=1024, max_num_seqs=2 * SEEDS)}


def _llm(files: dict, cell, **kw) -> LLM:
    extra = {"draft": {"draft_model": files["draft"]},
             "eagle": {"draft_head": files["eagle"]}}.get(cell.drafter, {})
    return LLM(model=files["model"], **files["engine"], **cell.engine_kwargs(), **extra, **kw)


def _plain(files) -> LLM:
    return LLM(model=files["model"], **files["engine"])


@pytest.fixture(scope="module")
def greedy_batch(files):
    """The greedy requests, one per parameter (and three siblings for n > 1), their prompts
    and their reference outputs (speculation off, sync)."""
    plain = _plain(files)
    tok = plain.tokenizer
    prompts = _branching_prompts(plain) + random_prompts(3, 280, seed=21, lo=8, hi=30,
                                                        repetitive=True)
    base = [o.token_ids for o in plain.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    reqs: list[tuple[str, int, SamplingParams]] = []

    def add(name: str, p: int, **kw) -> None:
        kw.setdefault("ignore_eos", True)
        reqs.append((name, p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)))

    n = len(prompts)
    add("plain", 0)
    add("seed", 1, seed=11)
    add("logit_bias", 2, logit_bias=((base[2][3], 4.0), (base[2][1], -100.0)), logprobs=2)
    add("presence_penalty", 3, presence_penalty=2.0, logprobs=1)
    add("frequency_penalty", 4, frequency_penalty=1.5, logprobs=1)
    add("repetition_penalty", 3, repetition_penalty=1.6, logprobs=1)
    add("min_tokens", 0, min_tokens=6, ignore_eos=False, logit_bias=((2, 6.0),))
    # a stop string met within an output that decodes to whole characters
    ps = next(i for i, b in enumerate(base) if "\ufffd" not in tok.decode(b[:8]))
    add("stop", ps, stop=(tok.decode(base[ps][4:6]),))
    add("stop_token_ids", 2, stop_token_ids=(base[2][6],))
    add("bad_words", 3, bad_words_ids=((base[3][2],), (base[3][4], base[3][5])))
    add("logprobs", 4, logprobs=0)
    add("top_logprobs", 5 % n, logprobs=4)
    for i in range(3):
        add(f"n>1 ({i})", 1, logprobs=1)
    add("structured_output", 0, structured_output=StructuredOutputParams(
        regex=r"[a-z ]{3,8}\.[0-9]{2,5}"))
    ref = plain.generate([prompts[p] for _, p, _ in reqs], [sp for _, _, sp in reqs])
    return prompts, base, reqs, ref


def _compare(reqs, ref, got, label: str) -> None:
    for (name, _, _), r, g in zip(reqs, ref, got):
        where = f"{label}, {name}"
        assert g.token_ids == r.token_ids, f"{where}: {g.token_ids} != {r.token_ids}"
        assert (g.text, g.finish_reason) == (r.text, r.finish_reason), where
        assert (g.logprobs is None) == (r.logprobs is None), where
        for i, (a, b) in enumerate(zip(r.logprobs or [], g.logprobs or [])):
            assert abs(a[0] - b[0]) <= LOGPROB_TOL, f"{where}: token {i} logprob {a[0]} vs {b[0]}"
            assert [t for t, _ in a[1]] == [t for t, _ in b[1]], f"{where}: top ids at {i}"
            assert max((abs(x - y) for (_, x), (_, y) in zip(a[1], b[1])), default=0.0) \
                <= LOGPROB_TOL, f"{where}: top logprobs at token {i}"


def test_the_reference_batch_has_teeth(greedy_batch):
    """Each parameter changes its request's output from plain greedy (else equality under
    speculation would prove nothing about it)."""
    prompts, base, reqs, ref = greedy_batch
    changed = {name for (name, p, sp), r in zip(reqs, ref)
               if r.token_ids != base[p][:len(r.token_ids)] or len(r.token_ids) < MAX_TOKENS}
    for name in ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "stop", "stop_token_ids", "bad_words", "structured_output"):
        assert name in changed, f"{name} did not change its request's output"
    assert re.fullmatch(r"[a-z ]{3,8}\.[0-9]{2,5}", ref[-1].text), ref[-1].text


@pytest.mark.parametrize("cell", [c for c in RUN if c.driver != "dp2"], ids=lambda c: c.name)
def test_greedy_equals_speculation_off(cell, files, greedy_batch):
    prompts, _, reqs, ref = greedy_batch
    llm = _llm(files, cell)
    got = llm.generate([prompts[p] for _, p, _ in reqs], [sp for _, _, sp in reqs])
    _compare(reqs, ref, got, cell.name)
    if cell.drafter != "none":
        c = llm.engine.counters
        assert c.num_accepted_tokens > 0, f"{cell.name}: nothing accepted"
        pen = [g for (name, _, _), g in zip(reqs, got) if name.endswith("_penalty")]
        assert sum(g.spec.counters.num_accepted_tokens for g in pen) > 0, \
            f"{cell.name}: the penalty requests accepted no draft"
        if cell.shape == "tree":
            assert c.num_tree_drafts > 0, f"{cell.name}: no tree verified"
    llm.engine.check_integrity()


@pytest.mark.parametrize("cell", [c for c in RUN if c.driver == "dp2"], ids=lambda c: c.name)
def test_greedy_data_parallel_equals_speculation_off(cell, files, greedy_batch):
    prompts, _, reqs, ref = greedy_batch
    llm = _llm(files, cell, dp_rank_timeout_s=30.0)
    pids = set(llm.engine.rank_pids().values())
    try:
        got = llm.generate([prompts[p] for _, p, _ in reqs], [sp for _, _, sp in reqs])
        _compare(reqs, ref, got, cell.name)
        assert llm.engine.counters.num_accepted_tokens > 0
    finally:
        llm.shutdown()
    assert_processes_gone(pids)


@pytest.mark.parametrize("cell", REFUSED, ids=lambda c: c.name)
def test_refused_cells_name_both_parts(cell, files):
    assert cell.refused is not None
    with pytest.raises(ValueError, match=re.escape(cell.refused)):
        _llm(files, cell)
    assert "--draft-tree" in cell.refused and repr(cell.drafter) in cell.refused


@pytest.mark.parametrize("cell", REFUSED, ids=lambda c: c.name)
def test_the_server_refuses_the_refused_cells_naming_both_parts(cell, files, capsys):
    """The server path: no request field picks a drafter, a draft shape or a driver (they are
    the server's own flags), so a refused cell is refused when `dynaspec serve` starts, with
    the same message, before a model is loaded or a port opened (exit status 2). Every request
    parameter composes with every cell the server can run (tests/server/
    test_composition_server.py: a speculating server answers none of them with a 400)."""
    from dynaspec.cli.main import main

    extra = {"draft": ["--draft-model", files["draft"]],
             "eagle": ["--draft-head", files["eagle"]]}.get(cell.drafter, [])
    argv = ["serve", "--model", files["model"], "--dtype", "float32", *extra,
            *cli_flags(cell.engine_kwargs()), "--port", "0"]
    assert main(argv) == 2
    assert f"dynaspec: error: {cell.refused}" in capsys.readouterr().err


# ---- sampled: the first tokens' distribution ---------------------------------------------
SAMPLED_SETS = {
    "truncation": dict(temperature=0.8, top_p=0.9, top_k=6, min_p=0.05),
    "processing": dict(temperature=1.0, logit_bias=((3, 1.0),), presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.2),
}
_PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repetitive: the lookup drafters match


def _first_tokens(llm: LLM, sets: dict[str, dict]) -> dict[str, list[tuple[int, ...]]]:
    """The first three tokens of SEEDS seeded requests per parameter set, in one batch: the
    first is sampled at the prefill, the next two at the first verify step (a draft budget of
    two: max_tokens leaves room for them)."""
    params = [SamplingParams(max_tokens=4, ignore_eos=True, seed=s, **kw)
              for kw in sets.values() for s in range(SEEDS)]
    outs = [tuple(o.token_ids[:3]) for o in llm.generate([_PROMPT] * len(params), params)]
    return {name: outs[i * SEEDS:(i + 1) * SEEDS] for i, name in enumerate(sets)}


def _p_values(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> tuple[float, float]:
    """The joint of the first two tokens, and the third token alone (too sparse jointly)."""
    return (_p_value([t[:2] for t in a], [t[:2] for t in b]),
            _p_value([t[2] for t in a], [t[2] for t in b]))


def _p_value(a: list, b: list) -> float:
    cats = sorted(set(a) | set(b))
    table = [[a.count(c) for c in cats], [b.count(c) for c in cats]]
    keep = [i for i in range(len(cats)) if table[0][i] + table[1][i] >= 5]
    rest = [sum(row[i] for i in range(len(cats)) if i not in keep) for row in table]
    table = [[row[i] for i in keep] + ([r] if sum(rest) else []) for row, r in zip(table, rest)]
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module")
def sampled_reference(small):
    plain = _plain(small)
    return _first_tokens(plain, SAMPLED_SETS)


def test_the_chi_square_rejects_a_wrong_distribution(small, sampled_reference):
    """Power: the same test, against samples at another temperature, rejects."""
    wrong = _first_tokens(_plain(small), {"t": {**SAMPLED_SETS["truncation"],
                                                "temperature": 1.2}})["t"]
    p = min(_p_values(sampled_reference["truncation"], wrong))
    assert p < P_MIN, f"the chi-square cannot tell temperature 0.8 from 1.2 (p={p:.3f})"


@pytest.mark.parametrize("cell", SAMPLED, ids=lambda c: c.name)
def test_sampled_distribution_equals_speculation_off(cell, small, sampled_reference):
    dp = cell.driver == "dp2"
    llm = _llm(small, cell, **({"dp_rank_timeout_s": 30.0} if dp else {}))
    pids = set(llm.engine.rank_pids().values()) if dp else set()
    try:
        got = _first_tokens(llm, SAMPLED_SETS)
        for name in SAMPLED_SETS:
            p = min(_p_values(sampled_reference[name], got[name]))
            assert p > P_MIN, f"{cell.name}, {name}: distribution differs (p={p:.4f})"
        assert llm.engine.counters.num_draft_tokens > 0, f"{cell.name}: nothing drafted"
        if dp:  # both ranks sampled (the requests were spread over them)
            assert all(c.num_emitted_tokens > 0 for c in llm.engine.query("counters"))
    finally:
        if dp:
            llm.shutdown()
    assert_processes_gone(pids)


# ---- the README table ----------------------------------------------------------------------
def test_readme_table_is_the_matrix():
    table = readme_table(README.read_text())
    assert table is not None, "README.md lost its composition-matrix section"
    assert table == render_table(), ("README's composition table differs from the matrix's "
                                     "cases: run `python -m tests.composition_cases --write`")


def test_every_cell_is_run_or_refused():
    all_cells = cells()
    assert len(all_cells) == 5 * 2 * 3
    assert all(c.run or c.refused or c.driver == "dp2" for c in all_cells)
    assert {c.drafter for c in all_cells if c.run and c.driver == "dp2"}, "no DP cell runs"
