"""Rank processes: ``python -m dynaspec.dp.rank`` with its RankSpec pickled on stdin.

A fresh interpreter rather than multiprocessing's spawn, so a user's script needs no
``if __name__ == "__main__"`` guard (spawn re-imports the main module). When started from the
main thread the child asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), so a
front end killed outright leaves no rank behind. The kernel ties that signal to the *thread*
that forked, so from any other thread (which may end long before the engine) it is not set;
the rank still leaves on its own when its control channel closes. ``sentinel`` (a pidfd) lets
the front end's pump wait on the exit.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time

from dynaspec.dp.messages import RankSpec

PDEATHSIG_ENV = "DYNASPEC_DP_PDEATHSIG"


class RankProcess:
    def __init__(self, spec: RankSpec) -> None:
        self.rank = spec.rank
        env = dict(os.environ)
        env[PDEATHSIG_ENV] = "1" if threading.current_thread() is threading.main_thread() else "0"
        # The child imports the same dynaspec as this process, whatever its working directory.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._popen = subprocess.Popen([sys.executable, "-m", "dynaspec.dp.rank"],
                                       stdin=subprocess.PIPE, close_fds=True, env=env)
        assert self._popen.stdin is not None
        self._popen.stdin.write(pickle.dumps(spec))
        self._popen.stdin.close()
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None

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
        if self.is_alive():
            self._popen.kill()


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (best effort elsewhere)."""
    if os.environ.get(PDEATHSIG_ENV) != "1":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass


def wait_all(procs: list[RankProcess], poll_s: float = 0.2) -> int:
    """Block until every process exits; the worst exit code (0 when all left cleanly)."""
    while any(p.is_alive() for p in procs):
        time.sleep(poll_s)
    return max((abs(p.exitcode or 0) for p in procs), default=0)
