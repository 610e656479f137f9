"""Running the support matrix (bench/matrix_run.py): with mock arms, each cell alternates plain,
drafter and oracle until the stopping rule, and what cannot run is an n/a cell with its reason;
then one real cell on a tiny checkpoint, and the CLI writing the Markdown."""

from __future__ import annotations

import itertools
import json

import pytest

from dynaspec.bench.compare import RunRecord
from dynaspec.bench.matrix import MATRIX_WORKLOADS, MatrixSettings
from dynaspec.bench.matrix_run import MatrixRun
from dynaspec.bench.workloads import WORKLOADS, WorkItem
from tests.cost_tables import FREE_VERIFY
from tests.e2e.conftest import random_prompts

MISSING = [w for w in MATRIX_WORKLOADS if w not in WORKLOADS]  # workloads not written yet


class MockArm:
    """`tokens` tokens per pass in the next of `seconds` (cycled); outputs the plain ones unless
    `wrong`."""

    def __init__(self, label, log, seconds, wrong=False):
        self.label, self.log, self.wrong = label, log, wrong
        self.seconds = itertools.cycle(seconds)
        self.tokenizer = None
        self.sizes = []  # (concurrency, prompts) of each pass

    def run(self, items, params, concurrency, tag):
        self.log.append((self.label, tag, concurrency))
        self.sizes.append((concurrency, len(items)))
        rec = RunRecord(self.label, -1, 100, next(self.seconds) if "warm" not in tag else 0.1)
        rec.outputs = [[len(it.prompt_ids) + (self.wrong and i == 0)] for i, it in
                       enumerate(items)]
        return rec

    def describe(self):
        return {"kind": "mock", "label": self.label}


def _load(name, tokenizer, n, seed):
    return [WorkItem([seed, i, len(name)], 8, f"{name}-{i}") for i in range(n)]


def _run(settings, log, recordings, on_cell=lambda cell: None):
    def build(label, flags):
        if label == "head":
            raise ValueError("no draft head for this model")
        seconds = {"plain": [1.0], "ngram": [0.5],
                   "suffix": [0.6, 0.9, 0.5, 1.1]}[label]  # suffix: noisy and wrong
        return MockArm(label, log, seconds, wrong=label == "suffix")

    def oracle(arm, recording):
        recordings.append(recording)
        return MockArm(f"oracle-{arm.label}", log, [0.25])

    return MatrixRun(settings, build=build, load=_load, oracle=oracle, say=lambda m: None,
                     on_cell=on_cell).run()


def test_cells_pair_plain_drafter_and_oracle_until_the_rule_stops_them():
    log, recordings = [], []
    s = MatrixSettings(concurrencies=(1, 4), workloads=("code_edit", "chat", *MISSING[:1]),
                       drafters=("default", "ngram", "suffix", "head"), num_prompts=3,
                       min_pairs=3, max_pairs=6)
    cells = _run(s, log, recordings)
    assert [(c.concurrency, c.workload, c.drafter) for c in cells] == \
        [(c, w, d) for c in s.concurrencies for w in s.workloads for d in s.drafters]
    by = {(c.concurrency, c.workload, c.drafter): c for c in cells}
    ngram = by[(4, "code_edit", "ngram")]
    assert ngram.status == "pass" and ngram.ratio.ratio == pytest.approx(2.0)
    assert ngram.ratio.n == 3, "steady: stops at min_pairs"
    assert ngram.oracle.ratio == pytest.approx(4.0)
    # c4 runs 4 prompts (at least one per slot) in each of its 3 pairs
    assert ngram.gain_capture == pytest.approx(1 / 3) and ngram.identical == (12, 12)
    suffix = by[(1, "chat", "suffix")]
    assert suffix.ratio.n == 6, "noisy: runs to the cap"
    assert suffix.status == "fail" and "drafter's greedy output differs" in suffix.reason
    assert by[(1, "code_edit", "head")].status == "n/a"
    assert "cannot build: no draft head" in by[(1, "code_edit", "head")].reason
    assert "do not speculate" in by[(4, "chat", "default")].reason
    for d in s.drafters:
        for c in s.concurrencies:
            for w in MISSING[:1]:
                assert by[(c, w, d)].status == "n/a" and "workload yet" in by[(c, w, d)].reason
    # One recording pass per runnable workload, before any drafter; one oracle per drafter
    # holding every workload's outputs.
    records = [e for e in log if "record" in e[1]]
    assert [e[1] for e in records] == ["plain-record-code_edit", "plain-record-chat"]
    assert log.index(records[-1]) < min(i for i, e in enumerate(log) if e[0] == "ngram")
    # 3 prompts asked, 4 loaded: a c4 cell runs at least 4 (one per slot), a c1 cell 3.
    assert len(recordings) == 2 and all(len(r["requests"]) == 8 for r in recordings)
    # Inside a cell the arms alternate: plain, drafter, oracle, once per pair.
    cell = [e[0] for e in log if e[2] == 4 and "warm" not in e[1] and e[0] != "suffix"
            and e[0] != "oracle-suffix"][:9]
    assert cell == ["plain", "ngram", "oracle-ngram"] * 3


def test_without_the_oracle_no_recording_pass_and_no_gain_capture():
    log, recordings = [], []
    s = MatrixSettings(concurrencies=(1,), workloads=("code_edit",), drafters=("ngram",),
                       num_prompts=2, min_pairs=2, max_pairs=2, oracle=False)
    (cell,) = _run(s, log, recordings)
    assert cell.oracle is None and cell.gain_capture is None and not recordings
    assert not [e for e in log if "record" in e[1]]


def test_a_cell_runs_at_least_as_many_prompts_as_its_concurrency():
    arms = []

    def build(label, flags):
        arms.append(MockArm(label, [], [1.0]))
        return arms[-1]

    s = MatrixSettings(concurrencies=(1, 4), workloads=("chat",), drafters=("ngram",),
                       num_prompts=2, min_pairs=2, max_pairs=2, oracle=False)
    MatrixRun(s, build=build, load=_load, say=lambda m: None).run()
    measured = {(c, n) for c, n in arms[1].sizes if n > 1}  # warm-ups run one prompt
    assert measured == {(1, 2), (4, 4)}


def test_every_measured_pass_is_logged_with_its_cpu_per_wall_second():
    said = []

    def build(label, flags):
        return MockArm(label, [], [1.0] if label == "plain" else [0.5])

    s = MatrixSettings(concurrencies=(1,), workloads=("chat",), drafters=("ngram",),
                       num_prompts=2, min_pairs=2, max_pairs=2, oracle=False)
    MatrixRun(s, build=build, load=_load, say=said.append).run()
    passes = [m for m in said if "tok/s, CPU/wall" in m]
    assert len(passes) == 4  # 2 pairs x (plain, drafter); warm-ups are not measured
    assert sum("= 200.0 tok/s" in m for m in passes) == 2  # the drafter's 100 tokens in 0.5 s


def test_each_cell_is_handed_on_as_it_finishes_so_a_part_cut_short_keeps_its_cells():
    seen = []
    s = MatrixSettings(concurrencies=(1, 4), workloads=("code_edit",), drafters=("ngram",),
                       num_prompts=2, min_pairs=2, max_pairs=2, oracle=False)
    cells = _run(s, [], [], on_cell=seen.append)
    assert seen == cells and len(seen) == 2


def test_the_cli_merges_parts_written_with_json_into_one_page(tmp_path):
    from dynaspec.bench.matrix import CellResult
    from dynaspec.bench.matrix_report import MatrixPart, Provenance
    from dynaspec.cli.main import main

    paths = []
    for c, status in ((1, "pass"), (16, "fail")):
        s = MatrixSettings(concurrencies=(c,), workloads=("chat",), drafters=("ngram",))
        part = MatrixPart(s, Provenance("abc", "cpu", "today", f"part c{c}"),
                          (CellResult(c, "chat", "ngram", status, "why" * (status == "fail")),))
        paths.append(tmp_path / f"c{c}.json")
        paths[-1].write_text(json.dumps(part.to_json()))
    out = tmp_path / "support-matrix.md"
    assert main(["bench", "matrix", "--merge", *map(str, paths), "--out", str(out)]) == 0
    md = out.read_text()
    assert "`part c1`" in md and "`part c16`" in md and "1 pass, 1 fail, 0 n/a of 2 cells" in md


def test_one_real_cell_on_a_tiny_checkpoint(tiny_llama_dir):
    prompts = random_prompts(3, 280, seed=3, lo=10, hi=30, repetitive=True)

    def load(name, tokenizer, n, seed):
        return [WorkItem(p, 12, f"p{i}") for i, p in enumerate(prompts[:n])]

    flags = (f"--model {tiny_llama_dir} --dtype float32 --num-kv-blocks 256 --num-threads 1 "
             f"--cost-table '{json.dumps(FREE_VERIFY)}'")
    s = MatrixSettings(concurrencies=(2,), workloads=("code_edit",), drafters=("ngram",),
                       engine_flags=flags, num_prompts=3, min_pairs=2, max_pairs=2)
    (cell,) = MatrixRun(s, load=load, say=lambda m: None).run()
    assert cell.ratio is not None and cell.ratio.n == 2 and cell.oracle is not None
    assert cell.identical == (6, 6), "greedy: ngram equals plain"
    assert cell.status in ("pass", "fail") and "differs" not in cell.reason


@pytest.mark.skipif(not MISSING, reason="every matrix workload exists")
def test_the_cli_writes_the_markdown_with_every_cell(tmp_path, capsys):
    from dynaspec.cli.main import main

    out = tmp_path / "support-matrix.md"
    rc = main(["bench", "matrix", "--workloads", ",".join(MISSING), "--drafters",
               "default,ngram", "--concurrency", "1,4", "--out", str(out)])
    assert rc == 0
    md = out.read_text()
    assert "## concurrency 1" in md and "## concurrency 4" in md and "- commit: " in md
    assert md.count("| n/a: no ") == 2 * 2 * len(MISSING)
    assert main(["bench", "matrix", "--drafters", "magic", "--out", str(out)]) == 2
    assert "unknown matrix drafter 'magic'" in capsys.readouterr().err


def test_a_drafter_with_flags_the_engine_does_not_take_is_an_na_cell():
    from dynaspec.bench.matrix import DRAFTER_FLAGS

    s = MatrixSettings(concurrencies=(1,), workloads=("code_edit",), drafters=("bad",),
                       drafter_flags={**DRAFTER_FLAGS, "bad": "--no-such-flag"}, num_prompts=2,
                       min_pairs=2, max_pairs=2)
    (cell,) = _run(s, [], [])
    assert cell.status == "n/a" and "cannot build: bad: not valid engine flags" in cell.reason
