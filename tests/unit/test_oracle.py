"""The replay oracle (spec_decode/drafters/oracle.py): it drafts the recorded continuation while
the output follows it and nothing otherwise; greedy output with it equals plain; the server
refuses it."""

from __future__ import annotations

import json

import pytest

from dynaspec import LLM
from dynaspec.config import SpecConfig
from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.oracle import OracleProposer, Recording, load_recording
from tests.cost_tables import FREE_VERIFY
from tests.e2e.conftest import random_prompts

PROMPT, REC = [5, 6, 7], [10, 11, 12, 13, 14, 15]


def _req(output: list[int], rid: str = "r", prompt: list[int] | None = None) -> Request:
    return Request(rid, list(prompt or PROMPT), SamplingParams(), output_token_ids=list(output))


def _oracle() -> OracleProposer:
    return OracleProposer(Recording.of([(PROMPT, REC), ([1, 2], [3])]))


def test_it_drafts_the_next_k_recorded_tokens_while_the_output_follows_the_recording():
    o = _oracle()
    req = _req([])
    assert o.propose([req], [3]).token_ids == [[10, 11, 12]]
    req.output_token_ids += [10, 11]
    d = o.propose([req], [3])
    assert d.token_ids == [[12, 13, 14]] and d.skip_reasons == [None] and d.probs is None
    req.output_token_ids += [12, 13, 14]
    assert o.propose([req], [3]).token_ids == [[15]], "cut at the recording's end"
    req.output_token_ids += [15]
    assert o.propose([req], [3]).skip_reasons == ["no_match"], "nothing past the end"


def test_once_the_output_leaves_the_recording_it_drafts_nothing_for_good():
    o = _oracle()
    req = _req([10, 99])
    d = o.propose([req], [4])
    assert d.token_ids == [[]] and d.skip_reasons == ["no_match"]
    # Even where later tokens happen to line up with the recording again.
    req.output_token_ids += [12]
    assert o.propose([req], [4]).token_ids == [[]]


def test_unknown_prompts_k0_and_batches_each_get_their_own_answer():
    o = _oracle()
    reqs = [_req([], "a"), _req([], "b", prompt=[9, 9]), _req([], "c", prompt=[1, 2]),
            _req([], "d")]
    d = o.propose(reqs, [2, 2, 2, 0])
    assert d.token_ids == [[10, 11], [], [3], []]
    assert d.skip_reasons == [None, "no_match", None, None]
    assert o.num_cached() == 3
    for rid in "abcd":
        o.forget(rid)
    assert o.num_cached() == 0


def test_a_new_request_under_an_old_id_starts_afresh():
    o = _oracle()
    assert o.propose([_req([10, 99])], [2]).token_ids == [[]]
    assert o.propose([_req([10])], [2]).token_ids == [[11, 12]]


def test_recordings_load_from_a_file_text_or_object_and_bad_ones_say_what_is_wrong(tmp_path):
    rec = Recording.of([(PROMPT, REC)])
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec.to_json()))
    for source in (str(path), json.dumps(rec.to_json()), rec.to_json(), rec):
        assert load_recording(source) == rec
    with pytest.raises(ValueError, match="neither a JSON file nor JSON text"):
        load_recording("no/such/file.json")
    with pytest.raises(ValueError, match="request 0: needs 'prompt' and 'output'"):
        load_recording({"requests": [{"prompt": [1], "output": ["x"]}]})
    with pytest.raises(ValueError, match="an oracle recording is"):
        load_recording([1, 2])


def test_the_oracle_and_its_recording_come_together():
    with pytest.raises(ValueError, match="needs --oracle-recording"):
        SpecConfig(speculator="oracle", num_spec_tokens=4)
    with pytest.raises(ValueError, match="applies to it only"):
        SpecConfig(speculator="ngram", num_spec_tokens=4, oracle_recording="{}")


def test_greedy_output_with_the_oracle_is_plain_and_every_draft_is_accepted(tiny_llama_dir):
    prompts = random_prompts(4, 280, seed=11, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, num_threads=1)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    # The last prompt is left out of the recording: the oracle drafts nothing for it.
    recording = Recording.of(zip(prompts[:3], ref[:3])).to_json()
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, num_threads=1,
              speculator="oracle", num_spec_tokens=4, oracle_recording=recording,
              cost_table=FREE_VERIFY)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens
    assert c.draft_skips.get("no_match", 0) > 0, "the unrecorded prompt drafts nothing"
    llm.engine.check_integrity()


def test_the_server_refuses_the_oracle():
    pytest.importorskip("fastapi")
    from dynaspec.server.api_server import build_async_engine

    with pytest.raises(ValueError, match="oracle replays recorded outputs .* server does not"):
        build_async_engine(speculator="oracle", num_spec_tokens=4, oracle_recording="{}")
