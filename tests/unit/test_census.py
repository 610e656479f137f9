"""`bench census` drives the engine's phases and accounts for every step it ran."""

from __future__ import annotations

from dataclasses import dataclass

from dynaspec import LLM
from dynaspec.bench.census import markdown, run_census
from dynaspec.sampling_params import SamplingParams
from tests.cost_tables import FREE_VERIFY
from tests.e2e.conftest import random_prompts


@dataclass
class _Item:
    prompt_ids: list[int]


def test_census_counts_every_step_and_width(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", speculator="ngram", num_spec_tokens=4,
              cost_table=FREE_VERIFY, num_kv_blocks=256)
    e = llm.engine
    items = [_Item(p) for p in random_prompts(3, 280, seed=5, lo=20, hi=40, repetitive=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(items)
    c0 = e.counters
    census = run_census(e, items, params, concurrency=1)
    rep = census.to_json()
    delta = e.counters - c0
    assert rep["tokens"] == 3 * 12 == delta.num_emitted_tokens
    assert rep["steps"] == delta.num_steps
    assert sum(rep["steps_by_k"].values()) == rep["steps"]
    assert {str(k): n for k, n in delta.steps_by_k.items()} == rep["steps_by_k"]
    assert rep["drafted_tokens"] == delta.num_draft_tokens
    assert rep["accepted_tokens"] == delta.num_accepted_tokens
    decode_steps = sum(row["steps"] for row in rep["widths"].values())
    assert 0 < decode_steps < rep["steps"], "prefill steps are kept out of the width table"
    assert rep["widths"]["1"]["median_table_s"] == 0.01, "the injected table's cost at width 1"
    assert all(row["median_table_s"] > 0 and row["median_run_s"] > 0
               for row in rep["widths"].values())
    text = markdown(rep, {"flags": "--speculator ngram", "workload": "random", "seed": 5,
                          "num_prompts": 3, "concurrency": 1})
    assert "steps by K" in text and "| 1 |" in text
    e.check_integrity()
