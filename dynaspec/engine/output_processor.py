"""Tokens to user-facing outputs: detokenization, stop strings, timing per request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dynaspec.models.tokenizer import IncrementalDetokenizer
from dynaspec.outputs import RequestOutput
from dynaspec.request import Request, RequestStatus


@dataclass
class RequestState:
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # the output text, cut before a stop string
    logprobs: list = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    stop_hit: bool = False


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, req: Request) -> None:
        self.states[req.request_id] = RequestState(req, IncrementalDetokenizer(self.tokenizer))

    def process(self, req: Request, new_tokens: list[int], finished: bool,
                logprobs: list | None) -> RequestOutput:
        """Returns the output; sets `stop_hit` when a stop string ends the request."""
        st = self.states[req.request_id]
        now = time.monotonic()
        if new_tokens:
            if req.first_token_time is None:
                req.first_token_time = now
            st.token_times.extend([now] * len(new_tokens))
        if logprobs:
            st.logprobs.extend(logprobs)
        if new_tokens or finished:
            self._update_text(st, req, new_tokens, finished)
        status = req.status
        if st.stop_hit and not status.finished:
            status = RequestStatus.FINISHED_STOPPED
        done = status.finished
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), new_token_ids=new_tokens, text=st.text,
            finished=done, finish_reason=status.value if done else None,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=st.logprobs if req.sampling_params.logprobs is not None else None,
        )
        if done:
            out.metrics = self._timings(st, now)
            del self.states[req.request_id]
        return out

    def _update_text(self, st: RequestState, req: Request, new_tokens: list[int],
                     finished: bool) -> None:
        # Incremental: decoding the whole output every step would be O(n^2) per request.
        prev = len(st.detok.text)
        st.detok.feed(new_tokens)
        if finished:
            st.detok.flush()
        text = st.detok.text
        stops = req.sampling_params.stop
        if stops:
            window = max(len(s) for s in stops)
            start = max(0, prev - window + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                cut, which = min(hits)
                text = text[:cut]
                st.stop_hit = True
                req.stop_reason = which
        st.text = text

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @staticmethod
    def _timings(st: RequestState, now: float) -> dict:
        req = st.request
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        itl = [b - a for a, b in zip(st.token_times, st.token_times[1:])]
        return {"ttft_s": ttft, "e2e_s": now - req.arrival_time, "inter_token_s": itl}
