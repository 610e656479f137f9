"""The composition matrix through the HTTP server (tests/composition_cases.py, docs/design.md §9):
a speculating server, chains and trees, sync and async, answers a request that combines every
request parameter of the matrix with a 200, and greedy with the same text and logprobs as the
server with speculation off. No request field refuses a drafter, shape or driver: those are the
server's flags, refused at start-up (tests/e2e/test_composition_matrix.py checks the messages).
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.composition_cases import cells

from .conftest import MODEL

pytest.importorskip("xgrammar")

REGEX = r"[a-z ]{3,8}\.[0-9]{2,5}"
PROMPT = [17, 33, 45, 17, 33, 45, 17, 33, 45, 17, 33]
# Every greedy parameter of the matrix in one request (GREEDY_PARAMETERS), two choices.
GREEDY = dict(temperature=0, max_tokens=14, n=2, seed=11, logprobs=2, presence_penalty=0.5,
              frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={"40": 2, "100": -100},
              min_tokens=4, stop=["zzzz"], stop_token_ids=[3], bad_words=["qq"],
              structured_outputs={"regex": REGEX})
# And the sampled ones (SAMPLED_PARAMETERS).
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=6, min_p=0.05, seed=5, max_tokens=12, n=2,
               logit_bias={"40": 1}, presence_penalty=0.5, frequency_penalty=0.5,
               repetition_penalty=1.2)
CELLS = [c for c in cells() if c.name in ("ngram-tree-async", "suffix-tree-sync",
                                          "draft-chain-sync")]


@pytest.fixture(scope="module")
def plain(live_server_factory, tiny_llama_dir):
    return live_server_factory(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                               num_kv_blocks=256)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                             **body}, timeout=120)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_every_parameter_composes_through_the_server(cell, plain, live_server_factory,
                                                     tiny_llama_dir):
    extra = {"draft_model": tiny_llama_dir} if cell.drafter == "draft" else {}
    spec = live_server_factory(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                               num_kv_blocks=256, **cell.engine_kwargs(), **extra)
    ref, got = _post(plain, GREEDY), _post(spec, GREEDY)
    assert got.status_code == 200, f"{cell.name}: {got.status_code} {got.text}"
    assert ref.status_code == 200, ref.text
    for r, g in zip(ref.json()["choices"], got.json()["choices"], strict=True):
        assert re.fullmatch(REGEX, g["text"]), g["text"]
        assert (g["text"], g["finish_reason"]) == (r["text"], r["finish_reason"]), cell.name
        lp_r, lp_g = r["logprobs"]["token_logprobs"], g["logprobs"]["token_logprobs"]
        assert len(lp_g) == len(lp_r) and max(abs(a - b) for a, b in zip(lp_r, lp_g)) <= 1e-5
    sampled = _post(spec, SAMPLED)
    assert sampled.status_code == 200, f"{cell.name}: {sampled.status_code} {sampled.text}"
    assert len(sampled.json()["choices"]) == 2
    stats = httpx.get(spec.url + "/metrics", timeout=30).text
    drafted = re.search(r"^dynaspec:spec_decode_num_draft_tokens_total\S* (\S+)$", stats, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0, f"{cell.name}: nothing drafted"
