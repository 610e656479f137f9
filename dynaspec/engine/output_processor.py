"""Tokens to user-facing outputs: detokenization, stop strings, timing per request.

The scheduler decides when a request ends, stop strings included, in the same step for every
driver (sync, async, data parallel): for a request with stop strings it hands the tokens it is
about to append to `check_stop`, which feeds them to the request's detokenizer one at a time and
says how many to keep. `process` builds the output, decoding the tokens of requests without stop
strings itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dynaspec.models.tokenizer import IncrementalDetokenizer, Tokenizer
from dynaspec.outputs import RequestOutput, RequestTimings
from dynaspec.request import Request


@dataclass
class RequestState:
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # the output text, cut before a stop string
    logprobs: list = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    stop_hit: bool = False  # text is final: cut before a stop string
    num_checked: int = 0  # output tokens fed through check_stop (min_tokens counts them)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, req: Request) -> None:
        self.states[req.request_id] = RequestState(req, IncrementalDetokenizer(self.tokenizer))

    def check_stop(self, req: Request, tokens: list[int]) -> int | None:
        """Decode the tokens the scheduler is about to append; when a stop string appears,
        return how many of them to keep (up to the one completing it), else None."""
        st = self.states.get(req.request_id)
        if st is None or st.stop_hit or not req.sampling_params.stop:
            return None
        for i, t in enumerate(tokens):  # one at a time: the same cut with or without drafts
            prev = len(st.detok.text)
            st.detok.feed([t])
            st.num_checked += 1
            # As vLLM: no stop string ends the output before min_tokens tokens are out.
            if st.num_checked < req.sampling_params.min_tokens:
                st.text = st.detok.text
                continue
            if self._cut(st, req, prev):
                return i + 1
        return None

    def process(self, req: Request, new_tokens: list[int], finished: bool,
                logprobs: list | None) -> RequestOutput:
        """The output after a step: tokens of a request with stop strings were decoded by
        `check_stop` already; the others are decoded here (off the scheduler's path, which
        under async scheduling overlaps the next forward)."""
        st = self.states[req.request_id]
        now = time.monotonic()
        if new_tokens and not req.sampling_params.stop:
            st.detok.feed(new_tokens)
            st.text = st.detok.text
        if new_tokens:
            if req.first_token_time is None:
                req.first_token_time = now
            st.token_times.extend([now] * len(new_tokens))
        if logprobs:
            st.logprobs.extend(logprobs)
        if finished and not st.stop_hit:  # end of stream: pending bytes come out
            prev = len(st.detok.text)
            st.detok.flush()
            self._cut(st, req, prev)
        status = req.status
        done = status.finished
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), new_token_ids=new_tokens, text=st.text,
            finished=done, finish_reason=status.value if done else None,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=st.logprobs if req.sampling_params.logprobs is not None else None,
            error=req.error if done else None,
        )
        if done:
            out.timings = self._timings(st, now)
            del self.states[req.request_id]
        return out

    def error(self, req: Request, exc: Exception) -> RequestOutput:
        """The final output of a request a failed step ended: the message, and the text of the
        tokens it produced before (cut before a stop string as ever)."""
        st = self.states.pop(req.request_id, None)
        text = ""
        if st is not None:
            if not st.stop_hit:  # pending bytes come out, as at any end of stream
                prev = len(st.detok.text)
                st.detok.flush()
                self._cut(st, req, prev)
            text = st.text
        elif req.output_token_ids:
            text = self.tokenizer.decode(list(req.output_token_ids))
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), [],
                             text=text, finished=True, finish_reason="error",
                             error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _cut(st: RequestState, req: Request, prev: int) -> bool:
        """Set the text from the detokenizer, cut before the first stop string that ends after
        `prev` characters (only the new tail is searched: decoding is incremental)."""
        text = st.detok.text
        stops = req.sampling_params.stop
        if stops:
            start = max(0, prev - max(len(s) for s in stops) + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                cut, which = min(hits)
                st.text, st.stop_hit, req.stop_reason = text[:cut], True, which
                return True
        st.text = text
        return False

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    @staticmethod
    def _timings(st: RequestState, now: float) -> RequestTimings:
        req = st.request
        ttft = (req.first_token_time - req.arrival_time) if req.first_token_time else None
        itl = tuple(b - a for a, b in zip(st.token_times, st.token_times[1:]))
        return RequestTimings(ttft, now - req.arrival_time, itl)
