"""The rank's heartbeat thread over a real pipe: it beats, keeps beating while the main thread
is inside one long torch op, shares the channel with the main thread's sends without
interleaving them, and ends when the channel closes."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import torch

from dynaspec.dp.heartbeat import HeartbeatSender, LockedChannel, beat_interval_s
from dynaspec.dp.messages import Heartbeat


def _drain(conn, timeout_s: float) -> list:  # type: ignore[no-untyped-def]
    got = []
    while conn.poll(timeout_s):
        got.append(conn.recv())
        timeout_s = 0.0
    return got


def test_interval_gives_five_beats_within_the_timeout_and_at_most_every_0_2_s():
    assert beat_interval_s(1.0) == 0.2 and beat_interval_s(10.0) == 0.2
    assert beat_interval_s(0.5) == 0.1


def test_beats_go_on_through_one_long_torch_op_and_stop_when_the_channel_closes():
    front, rank_end = Pipe()
    channel = LockedChannel(rank_end)
    sender = HeartbeatSender(channel, 3, 0.005).start()
    assert front.poll(10.0) and front.recv() == Heartbeat(3)
    a = torch.randn(2000, 2000)  # [2000, 2000]
    t0 = time.monotonic()
    torch.mm(a, a)  # one op, ~0.1-1 s of C++ with the GIL released: the beats continue
    t1 = time.monotonic()
    inside = [t for t in list(sender.sent_at) if t0 < t < t1]
    assert inside, f"no beat during a {t1 - t0:.2f} s torch op"
    # The main thread's messages and the beats share the channel: each arrives whole (read
    # meanwhile by a thread, as the front end's pump does, so the pipe never fills).
    got: list = []

    def read() -> None:
        while front.poll(10.0):
            got.append(front.recv())
            if got[-1] == ("report", 199, b"x" * 4096):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for i in range(200):
        channel.send(("report", i, b"x" * 4096))
    reader.join(30.0)
    reports = [m for m in got if not isinstance(m, Heartbeat)]
    assert reports == [("report", i, b"x" * 4096) for i in range(200)]
    assert all(m == Heartbeat(3) for m in got if isinstance(m, Heartbeat))
    channel.close()
    sender.thread.join(5.0)
    assert not sender.thread.is_alive()  # its next send failed: it left


def test_stop_ends_the_beats():
    front, rank_end = Pipe()
    sender = HeartbeatSender(LockedChannel(rank_end), 0, 0.005).start()
    assert front.poll(10.0)
    sender.stop()
    sender.thread.join(5.0)
    assert not sender.thread.is_alive()
    _drain(front, 0.0)
    assert not front.poll(0.05)


def test_the_first_beat_is_sent_before_start_returns():
    """So it precedes RankReady on the channel: a rank stopped right after it joined is still
    one the front end has heard beating, and is judged."""
    front, rank_end = Pipe()
    sender = HeartbeatSender(LockedChannel(rank_end), 1, 60.0).start()
    assert front.poll(0.0) and front.recv() == Heartbeat(1)
    assert not front.poll(0.0)  # the thread's next beat is a minute away
    sender.stop()
    sender.thread.join(5.0)
