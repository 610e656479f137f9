"""Rank processes: ``python -m dynaspec.dp.rank`` with its RankSpec pickled on stdin.

A fresh interpreter rather than multiprocessing's spawn, so a user's script needs no
``if __name__ == "__main__"`` guard (spawn re-imports the main module). The child asks the
kernel to kill it when its parent dies (PR_SET_PDEATHSIG), so a front end killed outright
leaves no rank behind. The kernel ties that signal to the *thread* that forked, so every rank
is forked by one spawner thread that lives as long as the process (the engine thread that
builds the front end, or the pump that starts a replacement, may end first).

Each rank leads its own process group (a new session): a terminal's Ctrl-C reaches only the
front end, which stops the ranks itself, and ``kill`` takes the rank's whole group (anything it
started) with it. ``sentinel`` (a pidfd) lets the front end's pump wait on the exit.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from dynaspec.dp.messages import RankSpec

PDEATHSIG_ENV = "DYNASPEC_DP_PDEATHSIG"
PARENT_ENV = "DYNASPEC_DP_PARENT_PID"


class _Spawner:
    """The one thread that forks every rank (module docstring)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def popen(self, args: list[str], env: dict) -> subprocess.Popen:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="dynaspec-dp-spawner",
                                               daemon=True)
                self.thread.start()
        done: Future = Future()
        self.jobs.put((args, env, done))
        return done.result()

    def _run(self) -> None:
        while True:
            args, env, done = self.jobs.get()
            try:
                done.set_result(subprocess.Popen(args, stdin=subprocess.PIPE, close_fds=True,
                                                 env=env, start_new_session=True))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)


_SPAWNER = _Spawner()


class RankProcess:
    def __init__(self, spec: RankSpec) -> None:
        self.rank = spec.rank
        env = dict(os.environ)
        env[PDEATHSIG_ENV], env[PARENT_ENV] = "1", str(os.getpid())
        # The child imports the same dynaspec as this process, whatever its working directory.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._popen = _SPAWNER.popen([sys.executable, "-m", "dynaspec.dp.rank"], env)
        assert self._popen.stdin is not None
        self._popen.stdin.write(pickle.dumps(spec))
        self._popen.stdin.close()
        self.pid = self._popen.pid
        # a pidfd where the OS has them (Linux; os.pidfd_open exists only there)
        self.sentinel = os.pidfd_open(self.pid) if sys.platform == "linux" else None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if not self.is_alive() and self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the rank's process group (works on a stopped process too)."""
        if self.is_alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self._popen.kill()


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (best effort elsewhere)."""
    if os.environ.get(PDEATHSIG_ENV) != "1":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # The parent died before prctl took effect (while this interpreter imported torch): the
        # orphan was re-parented, to init or to a sub-reaper, so compare with the pid it had.
        if str(os.getppid()) != os.environ.get(PARENT_ENV, str(os.getppid())):
            os._exit(1)
    except (OSError, AttributeError):
        pass


def wait_all(procs: list[RankProcess], poll_s: float = 0.2) -> int:
    """Block until every process exits; the worst exit code (0 when all left cleanly)."""
    while any(p.is_alive() for p in procs):
        time.sleep(poll_s)
    return max((abs(p.exitcode or 0) for p in procs), default=0)
