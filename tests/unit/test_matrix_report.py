"""The support matrix's Markdown (bench/matrix_report.py) on synthetic cells: provenance, the rule,
one table per concurrency, every cell shown (n/a ones with their reason)."""

from __future__ import annotations

from dynaspec.bench.matrix import CellResult, MatrixSettings
from dynaspec.bench.matrix_report import Provenance, markdown, provenance
from dynaspec.bench.stats import paired_ratio

PROV = Provenance("abc123", "AMD Ryzen (avx2)", "2025-01-01 00:00 UTC", "dynaspec bench matrix")


def _est(r: float, n: int = 5):
    return paired_ratio([100.0] * n, [100.0 * r * (1 + 0.001 * i) for i in range(n)])


def test_every_cell_is_a_row_under_its_concurrency_with_ratio_ci_oracle_and_result():
    s = MatrixSettings(concurrencies=(1, 16), workloads=("code_edit", "json_extract"),
                       drafters=("ngram",), engine_flags="--model m")
    cells = [
        CellResult(1, "code_edit", "ngram", "pass", "", _est(1.3), _est(4.0), 0.1, (8, 8)),
        CellResult(1, "json_extract", "ngram", "n/a", "no json_extract workload yet"),
        CellResult(16, "code_edit", "ngram", "fail", "below plain: 0.900x", _est(0.9),
                   None, None, (8, 8)),
        CellResult(16, "json_extract", "ngram", "n/a", "no json_extract workload yet"),
    ]
    md = markdown(cells, s, PROV)
    for line in ("- commit: abc123", "- CPU: AMD Ryzen (avx2)", "- date: 2025-01-01 00:00 UTC",
                 "- command: `dynaspec bench matrix`", "**1 pass, 1 fail, 2 n/a of 4 cells.**",
                 "## concurrency 1", "## concurrency 16", "ngram = `--speculator ngram"):
        assert line in md, line
    c1, c16 = md.split("## concurrency 16")
    est, ora = cells[0].ratio, cells[0].oracle
    assert (f"| code_edit | ngram | {est.ratio:.3f}x | [{est.lo:.3f}, {est.hi:.3f}] | "
            f"{ora.ratio:.3f}x | 10.0% | 8/8 | 5 | **pass** |") in c1
    assert "| json_extract | ngram | - | - | - | - | - | - | n/a: no json_extract workload yet |" \
        in c1
    assert "| code_edit | ngram | 0.90" in c16 and "**FAIL**: below plain: 0.900x" in c16
    assert "| - | - | 8/8 | 5 |" in c16, "no oracle: no oracle ratio nor gain capture"


def test_sampled_cells_say_so_instead_of_a_greedy_count():
    s = MatrixSettings(concurrencies=(1,), workloads=("creative",), drafters=("suffix",))
    md = markdown([CellResult(1, "creative", "suffix", "pass", "", _est(1.1), _est(1.5), 0.2,
                              None)], s, PROV)
    assert "| sampled | 5 | **pass** |" in md


def test_provenance_names_a_commit_the_cpu_and_the_date():
    p = provenance("dynaspec bench matrix --drafters ngram")
    assert p.commit and p.cpu and p.date.endswith("UTC")
    assert p.command == "dynaspec bench matrix --drafters ngram"


def test_parts_round_trip_through_json_and_merge_into_one_page():
    import json

    from dynaspec.bench.matrix_report import MatrixPart, markdown_parts

    s1 = MatrixSettings(concurrencies=(1,), workloads=("code_edit",), drafters=("ngram",),
                        num_prompts=6)
    s16 = MatrixSettings(concurrencies=(16,), workloads=("code_edit",), drafters=("ngram",),
                         num_prompts=16, max_tokens=64, oracle=False)
    p1 = MatrixPart(s1, PROV, (CellResult(1, "code_edit", "ngram", "pass", "", _est(1.3),
                                          _est(4.0), 0.1, (8, 8)),))
    p16 = MatrixPart(s16, Provenance("def456", "cpu", "2025-01-02 00:00 UTC", "part two"),
                     (CellResult(16, "code_edit", "ngram", "fail", "below plain", _est(0.9),
                                 None, None, (16, 16)),))
    back = [MatrixPart.from_json(json.loads(json.dumps(p.to_json()))) for p in (p1, p16)]
    assert back == [p1, p16]
    md = markdown_parts(back)
    assert "Part 1 of 2:" in md and "Part 2 of 2:" in md
    assert "- command: `dynaspec bench matrix`" in md and "- command: `part two`" in md
    assert "max(16, concurrency) prompts per cell (seed 0), max_tokens 64" in md
    assert "oracle off" in md
    assert "**1 pass, 1 fail, 0 n/a of 2 cells.**" in md
    c1, c16 = md.split("## concurrency 16")
    assert "| code_edit | ngram | 1.30" in c1 and "| code_edit | ngram | 0.90" in c16


def test_a_cell_measured_again_in_a_later_part_shows_the_later_one():
    from dynaspec.bench.matrix_report import MatrixPart, markdown_parts

    s = MatrixSettings(concurrencies=(1,), workloads=("chat",), drafters=("suffix",))
    old = MatrixPart(s, PROV, (CellResult(1, "chat", "suffix", "fail", "below plain",
                                          _est(0.9), None, None, (4, 4)),))
    new = MatrixPart(s, PROV, (CellResult(1, "chat", "suffix", "pass", "", _est(1.2), None,
                                          None, (4, 4)),))
    md = markdown_parts([old, new])
    assert "**1 pass, 0 fail, 0 n/a of 1 cells.**" in md and "FAIL" not in md
