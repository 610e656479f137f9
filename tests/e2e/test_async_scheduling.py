"""--async-scheduling: the same greedy output as the sync step, token for token (docs/design.md
§7b).

Each comparison runs the same prompts through a sync and an async engine (fp32, tiny model),
batched, with and without n-gram speculation, with stop strings and max_tokens that cut in the
middle of an accepted run, and checks the books (identities, emitted == returned, pool clean).
The pipeline's order is fixed (the engine thread waits for each forward before it applies it),
so these runs are deterministic whatever the thread timing.
"""

from __future__ import annotations

import pytest

from dynaspec import LLM, SamplingParams
from tests.cost_tables import FREE_VERIFY

from .conftest import assert_greedy_equal, greedy, random_prompts, watch_steps


def _engine(model: str, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 512)
    if kw.get("speculator", "none") != "none":
        kw.setdefault("cost_table", FREE_VERIFY)  # the default policy, deterministic: it drafts
    return LLM(model=model, dtype="float32", enable_prefix_caching=False,
               async_scheduling=async_scheduling, **kw)


def _both(model: str, prompts, params, **kw):
    outs = {}
    for mode in (False, True):
        llm = _engine(model, mode, **kw)
        outs[mode] = (llm.generate(prompts, params), llm)
    return outs[False], outs[True]


def _check_books(llm: LLM, outs, streamed: int | None = None) -> None:
    c = llm.engine.counters
    assert c.check_identities() == []
    returned = sum(len(o.token_ids) for o in outs) if streamed is None else streamed
    assert c.num_emitted_tokens == returned
    for o in outs:
        if o.spec is not None:
            assert o.spec.counters.num_emitted_tokens == len(o.token_ids)
    llm.engine.check_integrity()
    assert not llm.engine.driver.busy
    assert not llm.engine.runner.generators, "runner state leaked"
    proposer = llm.engine.runner.proposer
    if proposer is not None:
        assert proposer.num_cached() == 0, "drafter state leaked"


@pytest.fixture(scope="module")
def prompts12():
    return random_prompts(6, 280, seed=21, lo=4, hi=50, repetitive=True) + \
        random_prompts(6, 280, seed=22, lo=4, hi=50)


@pytest.mark.parametrize("spec", [{}, {"speculator": "ngram", "num_spec_tokens": 4,
                                       "prompt_lookup_min": 1}])
def test_async_equals_sync_batched(tiny_llama_dir, prompts12, spec):
    # Different max_tokens per request: some end mid-verify while others keep running.
    params = [greedy(8 + 5 * (i % 4), ignore_eos=True) for i in range(len(prompts12))]
    (ref, sync_llm), (got, async_llm) = _both(tiny_llama_dir, prompts12, params, **spec)
    for i, (p, a, b) in enumerate(zip(prompts12, ref, got)):
        assert len(b.token_ids) == params[i].max_tokens, f"prompt {i}"
        assert b.finish_reason == a.finish_reason == "length"
        assert_greedy_equal(tiny_llama_dir, p, a.token_ids, b.token_ids, f"async {spec} prompt {i}")
    _check_books(sync_llm, ref)
    _check_books(async_llm, got)
    # Both paths count each prompt token once (no preemption, no prefix cache here).
    assert (
        sync_llm.engine.scheduler.num_preemptions == async_llm.engine.scheduler.num_preemptions == 0
    )
    prompt_total = sum(len(p) for p in prompts12)
    assert sync_llm.engine.counters.num_prompt_tokens == prompt_total
    assert async_llm.engine.counters.num_prompt_tokens == prompt_total
    if spec:
        c = async_llm.engine.counters
        assert c.num_accepted_tokens > 0, "the workload must exercise acceptance"


def test_max_tokens_cuts_mid_verify(tiny_llama_dir, prompts12):
    """max_tokens ends requests inside accepted runs; the async caps were formed before the
    previous step landed, so some budgeted slots turn out past max_tokens: async_placeholder."""
    spec = {"speculator": "ngram", "num_spec_tokens": 6, "prompt_lookup_min": 1}
    prompts = [p for p in prompts12[:6]]  # repetitive: long accepted runs
    params = [greedy(m, ignore_eos=True) for m in (3, 5, 7, 9, 11, 13)]
    (ref, _), (got, llm) = _both(tiny_llama_dir, prompts, params, **spec)
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        assert len(b.token_ids) == params[i].max_tokens
        assert_greedy_equal(tiny_llama_dir, p, a.token_ids, b.token_ids, f"max_tokens prompt {i}")
    _check_books(llm, got)
    c = llm.engine.counters
    assert c.invalid_draft_tokens.get("async_placeholder", 0) > 0, "the workload must cut caps"
    assert "async_placeholder" not in c.draft_skips  # a reason of invalid tokens, never a skip
    assert c.num_draft_tokens == sum(c.drafted_per_pos)
    # Per request, the same rules: no request ended early here, so the per-request counters
    # add up to the engine's.
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
        assert sum(getattr(o.spec.counters, name) for o in got) == getattr(c, name), name
    for key in ("async_placeholder", "all_invalid"):
        field = "invalid_draft_tokens" if key == "async_placeholder" else "draft_skips"
        assert sum(getattr(o.spec.counters, field).get(key, 0) for o in got) == \
            getattr(c, field).get(key, 0), key


def _stop_case(llm_ref: LLM, prompt: list[int], n: int) -> str | None:
    """A stop string taken from the middle of the reference output (so it cuts mid-step)."""
    out = llm_ref.generate([prompt], greedy(n, ignore_eos=True))[0]
    text = out.text
    return text[len(text) // 2: len(text) // 2 + 2] if len(text) >= 6 else None


def test_stop_strings_cut_the_same(tiny_llama_dir, prompts12):
    spec = {"speculator": "ngram", "num_spec_tokens": 4, "prompt_lookup_min": 1}
    ref_llm = _engine(tiny_llama_dir, False, **spec)
    prompts, params = [], []
    for p in prompts12:
        stop = _stop_case(ref_llm, p, 24)
        if stop and stop.strip():
            prompts.append(p)
            params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                         stop=[stop]))
    assert len(prompts) >= 4, "the workload must produce stop strings"
    (ref, _), (got, llm) = _both(tiny_llama_dir, prompts, params, **spec)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), i
    assert any(o.finish_reason == "stop" for o in got)
    _check_books(llm, got)


def test_stop_string_ends_the_request_in_the_step_that_found_it(tiny_llama_dir, prompts12):
    """The scheduler checks stop strings when a step lands, for the async driver as for sync:
    the step whose tokens complete a stop string is the request's last row (it used to be found
    one step late, with the next step's row run and thrown away)."""
    spec = {"speculator": "ngram", "num_spec_tokens": 4, "prompt_lookup_min": 1}
    ref_llm = _engine(tiny_llama_dir, False, **spec)
    prompts, params = [], []
    for p in prompts12:
        stop = _stop_case(ref_llm, p, 24)
        if stop and stop.strip():
            prompts.append(p)
            params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                         stop=[stop]))
    llm = _engine(tiny_llama_dir, True, **spec)
    seen = watch_steps(llm)
    outs = llm.generate(prompts, params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "the workload must stop on a stop string"
    for o in stopped:
        rows = [r for plan, res in seen for s, r in zip(plan.scheduled, res.results)
                if s.request.request_id == o.request_id and r.token_ids]
        before_last = sum(len(r.token_ids) for r in rows[:-1])
        assert before_last < len(o.token_ids) <= before_last + len(rows[-1].token_ids), \
            f"{o.request_id}: a row ran after the step that completed its stop string"
    assert "async_placeholder" not in llm.engine.counters.draft_skips
    _check_books(llm, outs)


def test_stop_string_and_abort_while_in_flight_account_drafts(tiny_llama_dir, prompts12):
    """A request ended while its next step is in flight: that step's row counts
    async_placeholder (never num_draft_tokens) and it emits nothing more."""
    spec = {"speculator": "ngram", "num_spec_tokens": 4, "prompt_lookup_min": 1}
    llm = _engine(tiny_llama_dir, True, **spec)
    eng = llm.engine
    ids = [eng.add_request(p, greedy(40, ignore_eos=True)) for p in prompts12[:4]]
    streamed = 0
    for _ in range(6):
        streamed += sum(len(o.new_token_ids) for o in eng.step())
    assert eng.driver.inflight is not None
    inflight = [s.request.request_id for s in eng.driver.inflight.plan.scheduled]
    victim = inflight[0]
    assert eng.abort_request(victim)
    before = eng.counters
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
            streamed += len(o.new_token_ids)
    assert victim not in outs, "an aborted request emits nothing more"
    assert set(outs) == set(ids) - {victim}
    delta = eng.counters - before
    assert delta.invalid_draft_tokens.get("async_placeholder", 0) > 0
    assert delta.check_identities() == []
    _check_books(llm, list(outs.values()), streamed)


def test_1000_aborts_during_in_flight_steps_leak_nothing(tiny_llama_dir, prompts12):
    """Requests aborted at every point of the pipeline (queued, in the step in flight, landed
    but not returned): every KV block comes back and no runner state is left."""
    llm = _engine(tiny_llama_dir, True, num_kv_blocks=64, speculator="ngram", num_spec_tokens=3,
                  prompt_lookup_min=1, max_num_seqs=8)
    eng = llm.engine
    in_flight_aborts = aborts = 0
    keep = eng.add_request(prompts12[0], greedy(30, ignore_eos=True))  # served throughout
    kept_out = []
    for round_ in range(125):
        ids = [eng.add_request(prompts12[(round_ + i) % 12], greedy(16, ignore_eos=True))
               for i in range(8)]
        for _ in range(1 + round_ % 3):
            kept_out += [o for o in eng.step() if o.request_id == keep]
        running = {s.request.request_id for s in eng.driver.inflight.plan.scheduled} \
            if eng.driver.inflight is not None else set()
        for rid in ids:
            in_flight_aborts += rid in running
            eng.abort_request(rid)
            aborts += 1
    while eng.has_unfinished_requests():
        kept_out += [o for o in eng.step() if o.request_id == keep]
    assert aborts == 1000 and in_flight_aborts > 300
    assert kept_out[-1].finished and len(kept_out[-1].token_ids) == 30
    eng.check_integrity()
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks, "leaked blocks"
    assert not eng.runner.generators and eng.runner.proposer.num_cached() == 0
    assert not eng.outputs.states and not eng.recorder.num_tracked()
    assert eng.counters.check_identities() == []


def test_worker_failure_fails_only_that_steps_requests(tiny_llama_dir, prompts12):
    """The 4th forward raises on the worker: the requests in that step fail with the error; a
    request admitted to the next step (formed while the 4th ran) is served to the end."""
    llm = _engine(tiny_llama_dir, True, speculator="ngram", num_spec_tokens=3, prompt_lookup_min=1)
    eng = llm.engine
    prepare, run, launched, doomed = eng.runner.prepare, eng.runner.run, [], []

    def counting_prepare(out):  # engine thread: which step is which is deterministic
        p = prepare(out)
        launched.append(p)
        if len(launched) == 4:
            doomed.append(p)
        return p

    def flaky(p):
        if any(p is d for d in doomed):
            raise RuntimeError("injected forward failure")
        return run(p)

    eng.runner.prepare, eng.runner.run = counting_prepare, flaky
    first = [eng.add_request(p, greedy(12, ignore_eos=True)) for p in prompts12[:3]]
    outs: dict = {}
    while len(launched) < 4:
        outs.update((o.request_id, o) for o in eng.step())
    late = eng.add_request(prompts12[3], greedy(12, ignore_eos=True))
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    in_doomed = {s.request.request_id for s in doomed[0].out.scheduled}
    assert in_doomed == set(first)
    assert all(outs[r].finish_reason == "error" and "injected" in outs[r].error for r in first)
    assert outs[late].finish_reason == "length" and len(outs[late].token_ids) == 12
    again = llm.generate(prompts12[4:6], greedy(12, ignore_eos=True))  # keeps serving
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in again)
    eng.check_integrity()
    assert not eng.runner.generators and eng.runner.proposer.num_cached() == 0


def test_structured_output_async_equals_sync(tiny_llama_dir):
    """Grammar cuts happen in prepare on the landed state; the grammar advances in run."""
    pytest.importorskip("xgrammar")
    from dynaspec.structured import StructuredOutputParams

    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["fox", "dog"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["kind", "n"],
        "additionalProperties": False,
    }
    ref_llm = _engine(tiny_llama_dir, False)
    tok = ref_llm.tokenizer
    texts = ['{"kind": "fox", "n": 12} {"kind": "dog", "n": 3} ', "The quick brown fox. " * 3]
    prompts = [tok.encode(t)[:100] for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_output=StructuredOutputParams(json=schema))
    spec = {"speculator": "ngram", "num_spec_tokens": 3, "prompt_lookup_min": 1}
    (ref, _), (got, llm) = _both(tiny_llama_dir, prompts, params, **spec)
    for a, b in zip(ref, got):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    _check_books(llm, got)


def test_fixed_shape_path_under_async(tiny_llama_dir, prompts12):
    """The compiled (fixed-shape) path on the worker thread: rows padded to the width, the
    cut slots among the pads counted async_placeholder, not padding."""
    spec = {"speculator": "ngram", "num_spec_tokens": 3, "prompt_lookup_min": 1,
            "execution": "compiled", "compile_backend": "aot_eager"}
    params = [greedy(6 + 3 * (i % 3), ignore_eos=True) for i in range(6)]
    (ref, _), (got, llm) = _both(tiny_llama_dir, prompts12[:6], params, **spec)
    for i, (p, a, b) in enumerate(zip(prompts12, ref, got)):
        assert_greedy_equal(tiny_llama_dir, p, a.token_ids, b.token_ids, f"compiled prompt {i}")
    assert any(path != "eager" for path, _ in llm.engine.recorder.execution_steps)
    c = llm.engine.counters
    assert c.invalid_draft_tokens.get("padding", 0) > 0
    _check_books(llm, got)


def test_draft_model_async_equals_sync(tiny_llama_dir, prompts12):
    """A draft model drafts at the end of each step (engine thread), from the landed tokens;
    the target itself as the draft accepts often, so rollback and catch-up are exercised."""
    spec = {"speculator": "draft", "draft_model": tiny_llama_dir, "num_spec_tokens": 3}
    params = [greedy(10 + 3 * (i % 3), ignore_eos=True) for i in range(6)]
    (ref, _), (got, llm) = _both(tiny_llama_dir, prompts12[:6], params, **spec)
    for i, (p, a, b) in enumerate(zip(prompts12, ref, got)):
        assert_greedy_equal(tiny_llama_dir, p, a.token_ids, b.token_ids, f"draft prompt {i}")
    assert llm.engine.counters.num_accepted_tokens > 0
    _check_books(llm, got)
