"""LLMEngine: wires loader, model, KV pool, scheduler, runner, proposer and metrics; runs steps.

One step is `schedule -> execute -> update`. A failure inside a step fails only the requests in
that step (their blocks are freed); the engine keeps serving the others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dynaspec.config import EngineConfig
from dynaspec.engine.output_processor import OutputProcessor
from dynaspec.engine.builder import EngineParts, build_engine_parts
from dynaspec.metrics.stats import (RequestStepSpec, SpecCounters, StepStats,
                                    fold_request_history, fold_step)
from dynaspec.outputs import RequestOutput, SchedulerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import StepUpdate

log = logging.getLogger("dynaspec")


@dataclass
class StepTimes:
    schedule: float = 0.0
    prepare: float = 0.0
    draft: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    steps: int = 0


def check_prompt_ids(ids: list[int], vocab: int, max_model_len: int) -> None:
    """Raises ValueError naming what is wrong with a prompt (also the DP front end's check)."""
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                         f"max_model_len {max_model_len}")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.plan = parts.plan
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.kv = parts.kv
        self.max_model_len = parts.max_model_len
        self.outputs = OutputProcessor(parts.tokenizer)
        self.counters = SpecCounters()
        # Per request (record, step K) pairs, folded once when asked: folding every step costs.
        self.request_records: dict[str, list] = {}
        self.times = StepTimes()
        self.last_step: StepStats | None = None
        self.last_batch = None  # BatchDescriptor of the latest step
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.finished_times: list[dict] = []  # drained by the server's metrics
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming what is wrong."""
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(ids, self.parts.vocab_size, self.max_model_len)
        req = Request(request_id, ids, params)
        self.scheduler.add_request(req)
        self.outputs.add(req)
        self.request_records[request_id] = []
        return request_id

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return req is not None

    def _forget(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self.runner.forget(request_id)
        self.request_records.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            return []
        try:
            res = self.runner.execute(sched_out)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("step failed")
            return self._fail_step(sched_out, exc)
        t0 = time.perf_counter()
        updates = self.scheduler.update(sched_out, res)
        self._record(sched_out, res, updates, time.perf_counter() - t0)
        outs = [self._emit(u) for u in updates]
        return [o for o in outs if o is not None]

    def _emit(self, u: StepUpdate) -> RequestOutput | None:
        req = u.request
        out = self.outputs.process(req, u.new_token_ids, u.finished, u.result.logprobs)
        if u.finished or out.finished:
            out.spec = self.request_spec(req.request_id)
        if out.finished and not u.finished:  # a stop string ended it
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if out.finished:
            self.finished_times.append({**out.metrics, "num_prompt_tokens": req.num_prompt_tokens,
                                        "num_generation_tokens": req.num_output_tokens})
            self.runner.forget(req.request_id)
            self.request_records.pop(req.request_id, None)
        if not u.new_token_ids and not out.finished:
            return None
        return out

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        outs = []
        for s in sched_out.scheduled:
            rid = s.request.request_id
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            self._forget(rid)
            outs.append(RequestOutput(rid, s.request.prompt_token_ids, list(s.request.output_token_ids),
                                      [], finished=True, finish_reason="error",
                                      error=f"{type(exc).__name__}: {exc}"))
        return outs

    def _record(self, sched_out: SchedulerOutput, res, updates: list[StepUpdate], t_update: float) -> None:
        t = self.times
        t.steps += 1
        t.schedule += sched_out.schedule_seconds
        t.prepare += res.prepare_seconds
        t.draft += res.draft_seconds
        t.forward += res.forward_seconds
        t.sample += res.sample_seconds
        t.update += t_update
        specs = []
        for u in updates:
            r = u.result
            pads = {"padding": r.num_padding_tokens} if r.num_padding_tokens else {}
            skip = r.skip_reason if not r.num_draft_tokens and not pads else None
            specs.append(RequestStepSpec(r.request_id, r.num_draft_tokens, r.num_accepted_tokens,
                                         len(u.new_token_ids), skip, pads))
        num_gen = sum(len(u.new_token_ids) for u in updates)
        num_prompt = sum(s.num_new_tokens for s in sched_out.scheduled if not s.sampling) + \
            sum(s.num_new_tokens - 1 for s in sched_out.scheduled if s.sampling)
        self.num_prompt_tokens_total += num_prompt
        self.num_generation_tokens_total += num_gen
        step = StepStats(sched_out.step_k, tuple(specs), res.draft_seconds,
                         res.forward_seconds + res.sample_seconds, sched_out.schedule_seconds,
                         num_prompt, num_gen, len(sched_out.preempted_ids))
        self.counters = fold_step(self.counters, step)
        self.last_step = step
        self.last_batch = res.batch
        for spec in specs:
            records = self.request_records.get(spec.request_id)
            if records is not None:
                records.append((spec, sched_out.step_k))

    # ---- facts for reports ---------------------------------------------------------------
    def request_spec(self, request_id: str) -> dict | None:
        records = self.request_records.get(request_id)
        if records is None or self.plan.kind == "off":
            return None
        return fold_request_history(SpecCounters(), records).to_dict()

    def pool_report(self) -> dict:
        p = self.parts
        return {"num_blocks": p.kv.num_blocks, "block_size": p.kv.block_size,
                "num_tokens": p.kv.num_blocks * p.kv.block_size,
                "drafter_num_tokens": p.drafter_kv_tokens}

    def generate_sync(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.has_unfinished_requests():
            assert self.kv.num_free_blocks() == self.kv.num_blocks, "blocks leaked after all requests finished"

