"""The composition matrix's cases (docs/design.md §9) and the README table made from them.

One list says which engine cells exist (drafter x draft shape x driver), which of them the
matrix runs, which are refused and with what message, and which request parameters every run
cell is checked under. The matrix test (tests/e2e/test_composition_matrix.py) runs exactly
these cases; README's "What composes with what" table is `render_table()` of them, and a test
checks the README still says so (`python -m tests.composition_cases --write` rewrites it).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

DRAFTERS = ("none", "ngram", "suffix", "draft", "eagle")
SHAPES = ("chain", "tree")
DRIVERS = ("sync", "async", "dp2")

# Request parameters each run cell is checked under: greedy ones against the same request with
# speculation off (text, token ids, logprobs within 1e-5), sampled ones by a chi-square of the
# first tokens' distribution against speculation off.
GREEDY_PARAMETERS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens", "stop", "stop_token_ids", "bad_words", "logprobs",
                     "top_logprobs", "seed", "n>1", "structured_output")
SAMPLED_PARAMETERS = ("temperature", "top_p", "top_k", "min_p", "seed", "logit_bias",
                      "presence_penalty", "frequency_penalty", "repetition_penalty")

# Data-parallel cells cost two rank processes each: the matrix runs this sparse sample of them;
# the rest compose by the same code path and are not run on every suite run.
DP_RUN = frozenset({("ngram", "tree"), ("draft", "chain")})

# The sampled check (a few hundred requests per cell) runs on the synchronous cells and on a
# sample of the async and data-parallel ones; every other run cell is checked greedy.
SAMPLED_ASYNC = frozenset({("ngram", "tree"), ("draft", "chain")})
SAMPLED_DP = frozenset({("ngram", "tree")})

_LABEL = {"none": "no speculation", "ngram": "n-gram", "suffix": "suffix", "draft": "draft model",
          "eagle": "EAGLE head"}
_DRIVER_LABEL = {"sync": "sync", "async": "--async-scheduling", "dp2": "--data-parallel-size 2"}


@dataclass(frozen=True)
class Cell:
    drafter: str
    shape: str
    driver: str
    refused: str | None = None  # the start-up error's text (names both parts), when refused
    run: bool = True  # the matrix runs it (data-parallel cells are sampled)
    sampled: bool = True  # its sampled distribution is checked

    @property
    def name(self) -> str:
        return f"{self.drafter}-{self.shape}-{self.driver}"

    def engine_kwargs(self) -> dict:
        """The LLM(...) arguments of the cell, beyond the model and the drafters' files."""
        kw: dict = {}
        if self.drafter != "none":  # the table policy: every step drafts (no K=0 pricing)
            kw.update(speculator=self.drafter, k_policy="table",
                      num_spec_tokens=8 if self.shape == "tree" else 3)
        if self.drafter == "ngram" and self.shape == "chain":
            kw["prompt_lookup_min"] = 1
        if self.shape == "tree":
            kw["draft_tree"] = True
        if self.driver == "async":
            kw["async_scheduling"] = True
        if self.driver == "dp2":
            kw["data_parallel_size"] = 2
        return kw


_FLAGS = {"speculator": "--speculator", "k_policy": "--k-policy",
          "num_spec_tokens": "--num-spec-tokens", "prompt_lookup_min": "--prompt-lookup-min",
          "draft_tree": "--draft-tree", "async_scheduling": "--async-scheduling",
          "data_parallel_size": "--data-parallel-size"}


def cli_flags(kwargs: dict) -> list[str]:
    """The `dynaspec serve` flags of a cell's engine kwargs (Cell.engine_kwargs)."""
    out: list[str] = []
    for key, value in kwargs.items():
        out += [_FLAGS[key]] if value is True else [_FLAGS[key], str(value)]
    return out


def cells() -> list[Cell]:
    out = []
    for d in DRAFTERS:
        for s in SHAPES:
            for drv in DRIVERS:
                refused = None
                if s == "tree" and d not in ("ngram", "suffix"):
                    refused = f"--draft-tree needs --speculator ngram or suffix, got {d!r}"
                run = refused is None and (drv != "dp2" or (d, s) in DP_RUN)
                sampled = run and (drv == "sync" or (d, s) in {"async": SAMPLED_ASYNC,
                                                                "dp2": SAMPLED_DP}.get(drv, ()))
                out.append(Cell(d, s, drv, refused, run, sampled))
    return out


def _mark(c: Cell) -> str:
    if c.refused is not None:
        return "refused"
    if not c.run:
        return "composes (not run: DP sampled)"
    return "tested: greedy + sampled" if c.sampled else "tested: greedy"


def render_table() -> str:
    """The README's table: one row per drafter and shape, one column per driver."""
    head = "| drafter | shape | " + " | ".join(_DRIVER_LABEL[d] for d in DRIVERS) + " |"
    lines = [head, "|" + "---|" * (2 + len(DRIVERS))]
    by = {(c.drafter, c.shape, c.driver): c for c in cells()}
    for d in DRAFTERS:
        for s in SHAPES:
            row = [_LABEL[d], s] + [_mark(by[d, s, drv]) for drv in DRIVERS]
            lines.append("| " + " | ".join(row) + " |")
    refusals = sorted({c.refused for c in cells() if c.refused is not None})
    lines += ["", "Every tested cell is checked under each request parameter: greedy ("
              + ", ".join(f"`{p}`" for p in GREEDY_PARAMETERS) + ") equal to speculation off "
              "(text, token ids, logprobs within 1e-5); sampled ("
              + ", ".join(f"`{p}`" for p in SAMPLED_PARAMETERS) + ") by a chi-square of the "
              "first tokens against speculation off. Refused at start-up, with these messages: "
              + "; ".join(f"`{r}`" for r in refusals) + "."]
    return "\n".join(lines) + "\n"


START, END = "<!-- composition-matrix:start -->", "<!-- composition-matrix:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_table(text: str) -> str | None:
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    return None if m is None else m.group(1)


def write_readme() -> None:
    text = README.read_text()
    if readme_table(text) is None:
        raise SystemExit(f"README.md has no {START} ... {END} section")
    new = re.sub(re.escape(START) + r"\n.*?" + re.escape(END),
                 lambda _: f"{START}\n{render_table()}{END}", text, flags=re.S)
    README.write_text(new)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_readme()
    else:
        sys.stdout.write(render_table())
