"""The rank-loss scenario's judgement (bench/reliability_dp.py) on fake stream records: which
streams had streamed when the rank was lost, and the checks built on it. The client's count at
the signal races with tokens in flight, so a failed stream's own tokens and the engine's count
in its error are read too; a stream that truly streamed nothing must still complete."""

from __future__ import annotations

from types import SimpleNamespace

from dynaspec.bench.reliability_dp import _summary, had_streamed

T_SIG = 10.0
LOST = "generation failed: data-parallel rank 1 was lost (SIGKILL)"


def _checks(recs: list[dict]) -> dict:
    counts = SimpleNamespace(rank_losses=1, loss_times=[T_SIG + 0.1], requeued=0,
                             failed=sum("error" in r for r in recs), replacements=1)
    health = {"ok_again_at": T_SIG + 2.0, "statuses": {"ok"}}
    kv = [{"num_free_blocks": 8, "num_blocks": 8}]
    return _summary(recs, T_SIG, health, counts, kv, 1.0, "kill", 1.0)["checks"]


def _done(at_signal: int) -> dict:
    times = [T_SIG - 0.2 + 0.1 * i for i in range(at_signal + 2)]
    return {"times": times, "at_signal": at_signal, "finish": "length", "end": times[-1]}


def test_engine_count_in_the_error_marks_a_stream_as_streamed_despite_the_signal_race():
    # The engine had sent 2 tokens before the kill; the client had read none at the signal
    # and received none before the error (the failure chunk carries no text).
    raced = {"times": [], "at_signal": 0, "end": T_SIG + 0.1,
             "error": f"{LOST} (after 2 streamed token(s); not resumed)"}
    assert had_streamed(raced)
    checks = _checks([_done(0), _done(3), raced])
    assert checks["every_unstreamed_request_completed"]
    assert checks["only_streaming_requests_failed"]
    assert checks["failures_name_rank_1"]


def test_tokens_received_after_the_signal_but_before_the_error_count_as_streamed():
    late = {"times": [T_SIG + 0.01, T_SIG + 0.02], "at_signal": 0, "end": T_SIG + 0.1,
            "error": f"{LOST} (not resumed)"}
    assert had_streamed(late)
    assert _checks([_done(0), late])["only_streaming_requests_failed"]


def test_a_failed_stream_that_streamed_nothing_still_fails_both_checks():
    for error in (f"{LOST} (and no data-parallel rank could be started)",
                  f"{LOST} (after 0 streamed token(s); not resumed)"):
        never = {"times": [], "at_signal": 0, "end": T_SIG + 0.1, "error": error}
        assert not had_streamed(never)
        checks = _checks([_done(0), _done(2), never])
        assert not checks["every_unstreamed_request_completed"]
        assert not checks["only_streaming_requests_failed"]


def test_an_unstreamed_stream_that_ended_without_error_or_finish_fails_the_completion_check():
    cut = {"times": [T_SIG + 0.5], "at_signal": 0, "end": T_SIG + 0.6}  # no finish, no error
    assert not had_streamed(cut)
    checks = _checks([_done(1), cut])
    assert not checks["every_unstreamed_request_completed"]
    assert checks["only_streaming_requests_failed"]  # nothing failed with an error


def test_streams_counted_at_the_signal_stay_streamed():
    failed = {"times": [T_SIG - 0.1], "at_signal": 1, "end": T_SIG + 0.1,
              "error": f"{LOST} (after 1 streamed token(s); not resumed)"}
    assert had_streamed(failed)
    checks = _checks([_done(0), failed])
    assert checks["every_unstreamed_request_completed"] and checks["only_streaming_requests_failed"]
