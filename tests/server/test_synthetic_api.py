"""A server in --rejection-mode synthetic: the API never claims temperature-0 exactness; every
response, streamed or not, and the model card say "lossless": false."""

from __future__ import annotations

import pytest

from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL

PROMPT = "one two three four five six. one two three four five six. one two three four"


@pytest.fixture(scope="module")
def server(live_server_factory):
    # A fixed free-verify table: whether the policy drafts must not depend on this machine's
    # load (a busy run measured wide steps dear, chose K = 0 and drafted nothing).
    return live_server_factory(speculator="ngram", num_spec_tokens=4, prompt_lookup_min=1,
                               rejection_mode="synthetic", synthetic_acceptance="0.9,0.5",
                               cost_table=FREE_VERIFY)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_greedy_responses_say_not_lossless(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    spec = r.model_extra["dynaspec"]["spec"]
    assert spec["lossless"] is False and spec["num_draft_tokens"] > 0
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT}])
    assert chat.model_extra["dynaspec"]["spec"]["lossless"] is False


def test_stream_final_chunk_and_model_card_say_not_lossless(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["dynaspec"]["spec"]["lossless"] is False
    assert client.models.retrieve(MODEL).model_extra["dynaspec"]["lossless"] is False
