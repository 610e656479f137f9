"""ModelRunner with a stub model: it consumes the plan, pads to the planned width, accounts.

The stub target predicts `id + 1` after every token (one-hot logits), so a draft is accepted
exactly when it continues the count; the stub drafter proposes what each test says. No KV, no
attention: the runner's own work (drafts -> rows, padding, path choice, the accounting of every
draft slot) is what is under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dynaspec.outputs import RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from dynaspec.step_plan import BatchDescriptor, ScheduledRequest, StepPlan
from dynaspec.worker.model_runner import ModelRunner

VOCAB = 64


def _next_logits(ids: torch.Tensor) -> torch.Tensor:
    """[n] token ids -> [n, VOCAB] logits whose argmax is id + 1."""
    out = torch.full((ids.shape[0], VOCAB), -10.0)
    out[torch.arange(ids.shape[0]), (ids.clamp(min=0) + 1) % VOCAB] = 10.0
    return out


class StubModel:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.attn = SimpleNamespace(build_metadata=lambda batch: batch)
        self.eager_calls: list[list[int]] = []  # query lengths of each eager forward

    def forward(self, ids, positions, kv_caches, md, rows, attn,  # type: ignore[no-untyped-def]
                argmax_rows=None):
        self.eager_calls.append(list(md.query_lens))
        return _next_logits(ids)[rows]  # [R, vocab]

    def head(self, h, argmax_rows=None):  # type: ignore[no-untyped-def]
        return h  # the stub executor's "hidden states" are already its logits


class StubExecutor:
    """The fixed-shape path: records every (B, W) it ran; `raises` makes it fail."""

    path = "compiled"

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises
        self.backend = SimpleNamespace(build_metadata=lambda batch: batch)
        self.ran: list[tuple[int, int, int]] = []  # (B, W, tokens)
        self.failed: list[tuple[int, int]] = []

    def ready(self, b: int, w: int) -> bool:
        return (b, w) not in self.failed

    def run(self, ids, positions, md):  # type: ignore[no-untyped-def]
        if self.raises:
            raise RuntimeError("build failed")
        self.ran.append((md.num_reqs_padded, md.width, ids.shape[0]))
        return _next_logits(ids)  # [B*W, vocab]

    def fail(self, key, exc) -> None:  # type: ignore[no-untyped-def]
        self.failed.append(key)


class StubProposer(Proposer):
    def __init__(self, drafts: dict[str, list[int]]) -> None:
        self.drafts = drafts
        self.asked: dict[str, int] = {}

    def propose(self, requests, k_per_request) -> Drafts:  # type: ignore[no-untyped-def]
        out = []
        for r, k in zip(requests, k_per_request):
            self.asked[r.request_id] = k
            out.append(self.drafts.get(r.request_id, [])[:k])
        return Drafts(out, None, [None if d else "no_match" for d in out])

    def preempt(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None: ...


def _decoding(rid: str, last: int) -> Request:
    """A request whose last token `last` is the one to compute this step."""
    req = Request(rid, [last - 2, last - 1, last], SamplingParams(temperature=0.0, max_tokens=50))
    req.num_computed_tokens, req.status = 2, RequestStatus.RUNNING
    return req


def _plan(rows: list[tuple[Request, int]], batch: BatchDescriptor, k: int = 3,
          async_invalid: dict[str, int] | None = None) -> StepPlan:
    entries = tuple(ScheduledRequest(request=r, num_new_tokens=1, draft_budget=cap,
                                     skip_reason=None if cap else "schedule_zero", block_table=[0],
                                     sampling=True, num_lookahead=k,
                                     num_async_invalid=(async_invalid or {}).get(r.request_id, 0))
                    for r, cap in rows)
    return StepPlan(scheduled=entries, step_k=k, num_batched_tokens=len(rows), batch=batch)


def _runner(drafts: dict[str, list[int]], executor: StubExecutor | None = None):
    model = StubModel()
    buffers = SimpleNamespace(attn=None, max_tokens=0)  # too small: plain tensors are loaded
    runner = ModelRunner(model, [], 16, StubProposer(drafts), seed=0, buffers=buffers,
                         executor=executor)
    return runner, model


def _by_id(res: RunnerOutput) -> dict:
    return {r.request_id: r for r in res.results}


def test_eager_rows_are_ragged_and_accounted():
    a, b = _decoding("a", 10), _decoding("b", 30)
    # a: two right drafts then a wrong one; b: one right draft; caps 3 and 2.
    runner, model = _runner({"a": [11, 12, 40], "b": [31, 32, 33]})
    res = runner.execute(_plan([(a, 3), (b, 1)], BatchDescriptor("eager", 2, 4, 8)))
    assert runner.proposer.asked == {"a": 3, "b": 1}, "the runner drafts each request's cap"
    assert model.eager_calls == [[4, 2]], "eager rows are not padded"
    ra, rb = _by_id(res)["a"], _by_id(res)["b"]
    assert (ra.token_ids, ra.num_draft_tokens, ra.num_accepted_tokens) == ((11, 12, 13), 3, 2)
    assert (rb.token_ids, rb.num_draft_tokens, rb.num_accepted_tokens) == ((31, 32), 1, 1)
    assert ra.num_padding_tokens == rb.num_padding_tokens == 0
    assert res.batch.path == "eager" and res.verified_width == 4


def test_fixed_shape_pads_every_row_to_the_planned_width():
    a, b, c = _decoding("a", 10), _decoding("b", 30), _decoding("c", 50)
    ex = StubExecutor()
    runner, model = _runner({"a": [11, 12, 13], "b": [31]}, ex)  # c: no match
    res = runner.execute(_plan([(a, 3), (b, 3), (c, 3)], BatchDescriptor("compiled", 4, 4, 16)))
    assert ex.ran == [(4, 4, 16)] and not model.eager_calls, "one fixed-shape forward, 4 x 4"
    r = _by_id(res)
    counts = {rid: (x.token_ids, x.num_draft_tokens, x.num_padding_tokens) for rid, x in r.items()}
    assert counts["a"] == ((11, 12, 13, 14), 3, 0)
    assert counts["b"] == ((31, 32), 1, 2)
    # No real draft: a padded row, not a draft and not a skip (its slots are invalid padding).
    assert (r["c"].token_ids, r["c"].num_draft_tokens, r["c"].num_padding_tokens) == ((51,), 0, 3)
    assert r["c"].skip_reason is None
    assert res.batch == BatchDescriptor("compiled", 4, 4, 16) and res.verified_width == 4


def test_async_invalid_slots_are_counted_apart_from_padding():
    a = _decoding("a", 10)
    runner, _ = _runner({"a": [11, 12, 13]}, StubExecutor())
    # The plan was revised (async): the cap fell from 3 to 1, 2 slots are async placeholders.
    res = runner.execute(_plan([(a, 1)], BatchDescriptor("compiled", 1, 4, 4),
                               async_invalid={"a": 2}))
    r = _by_id(res)["a"]
    assert (r.num_draft_tokens, r.num_async_invalid_tokens, r.num_padding_tokens) == (1, 2, 0)


def test_fixed_shape_failure_falls_back_to_eager_and_marks_the_shape():
    a, b = _decoding("a", 10), _decoding("b", 30)
    ex = StubExecutor(raises=True)
    runner, model = _runner({"a": [11, 12, 13], "b": [31]}, ex)
    res = runner.execute(_plan([(a, 3), (b, 3)], BatchDescriptor("compiled", 2, 4, 8)))
    assert ex.failed == [(2, 4)]
    assert res.batch.path == "eager" and res.batch.width == 4
    assert model.eager_calls == [[4, 4]], "the eager fallback runs the padded rows as planned"
    r = _by_id(res)
    assert r["a"].token_ids == (11, 12, 13, 14) and r["b"].token_ids == (31, 32)
    assert r["b"].num_padding_tokens == 2
