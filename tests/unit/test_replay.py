"""Replay: accepted tokens per step of model-free drafters over recorded greedy outputs."""

from __future__ import annotations

import json

import pytest

from dynaspec.bench.replay import main, make_model_free_proposer, replay
from dynaspec.config import SpecConfig

OUT = list(range(10, 40))  # an output no prompt contains
RECORDS = [{"prompt": [1, 2, 3], "output": OUT}, {"prompt": [4, 5, 6], "output": OUT}]


def test_suffix_global_cache_drafts_the_repeated_output_ngram_cannot():
    suffix = make_model_free_proposer(SpecConfig(speculator="suffix", num_spec_tokens=8))
    ngram = make_model_free_proposer(SpecConfig(speculator="ngram", num_spec_tokens=8))
    s, n = replay(suffix, RECORDS, 8), replay(ngram, RECORDS, 8)
    assert s["tokens"] == n["tokens"] == 60
    assert n["steps"] == 60 and n["drafted_per_step"] == 0.0, "nothing repeats within a request"
    assert s["steps"] < 45 and s["acceptance_rate"] == 1.0, (
        "the second request drafts from the first"
    )
    off = make_model_free_proposer(SpecConfig(speculator="suffix", num_spec_tokens=8,
                                              suffix_cache_max_requests=0))
    assert replay(off, RECORDS, 8)["steps"] == 60


def test_cli_replays_a_recording(tmp_path, capsys):
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(RECORDS))
    assert (
        main(["--record", str(path), "--drafter", "--speculator suffix --num-spec-tokens 4"]) == 0
    )
    line = json.loads(capsys.readouterr().out.strip())
    assert line["tokens"] == 60 and line["acceptance_rate"] == 1.0
    with pytest.raises(ValueError, match="model-free drafter"):
        make_model_free_proposer(SpecConfig(speculator="draft", num_spec_tokens=2, draft_model="x"))
