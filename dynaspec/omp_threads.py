"""OpenMP worker teams when torch work moves between threads.

libgomp gives every thread that runs a parallel region its own worker team and keeps it after
the region. Once the teams' threads outnumber the cores, every team spins only briefly and
then sleeps on a futex at each region; on 2 cores a step of an engine built on one thread and
run on another took 2-3.5x as long. A thread that hands its torch work to another one releases
its team here (OpenMP 5.0 `omp_pause_resource_all`; torch's bundled libgomp implements it).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

log = logging.getLogger("dynaspec")

_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    import torch

    for name in (os.path.join(torch.__path__[0], "lib", "libgomp.so.1"), "libgomp.so.1"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None  # another OpenMP runtime (or none loaded): nothing to release


def release_omp_pool() -> bool:
    """Release the OpenMP threads the runtime keeps; the next parallel region makes new ones.

    Call it only where no parallel region is running. True if a libgomp released them."""
    lib = _libgomp()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0


# How long an idle OpenMP thread of a server spins before it sleeps (libgomp's default is
# 300,000). With a load generator on the same 2 cores (aiperf, c16), the default spin let the
# server collapse to 16-100 output tok/s against 125-139 at 2,000 and 150 with no spin; with
# the cores to itself it ran 647 tok/s at the default, 681 at 2,000 and 350 with no spin
# (docs/history/benchmarks-waves-1-4.md, "Wave 3, fourth session"). A server shares its machine with
# its clients, the HTTP loop and tokenizers, so it takes the short spin.
SERVER_SPIN_COUNT = 2000


def set_server_spin() -> bool:
    """Give libgomp the server's spin count, unless the user chose a wait policy or spin count.

    Works only before torch (and with it libgomp) is loaded: libgomp reads it once. True if set.
    """
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SERVER_SPIN_COUNT)
    return True
