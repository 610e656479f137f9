"""omp_threads: the server's spin count is set only before torch loads and never over the user's
choice; releasing a thread's OpenMP team leaves torch working."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from dynaspec.omp_threads import SERVER_SPIN_COUNT, release_omp_pool

_PROBE = ("import os, sys; from dynaspec.omp_threads import set_server_spin; "
          "pre = sys.argv[1] == 'torch-first'; pre and __import__('torch'); "
          "print(set_server_spin(), os.environ.get('GOMP_SPINCOUNT'))")


def _env_without_omp() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def _probe(mode: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env={**_env_without_omp(), **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_server_spin_is_set_before_torch_loads() -> None:
    assert _probe("plain") == f"True {SERVER_SPIN_COUNT}"


def test_server_spin_leaves_the_users_choice_and_a_loaded_torch_alone() -> None:
    assert _probe("plain", GOMP_SPINCOUNT="50") == "False 50"
    assert _probe("plain", OMP_WAIT_POLICY="active") == "False None"
    assert _probe("torch-first") == "False None"  # too late: libgomp has read its settings


def test_release_keeps_torch_working() -> None:
    x = torch.arange(1 << 18, dtype=torch.float32)  # large enough for a parallel region
    before = float(x.sum())
    assert release_omp_pool()  # torch's libgomp is loaded on Linux
    assert float(x.sum()) == before  # the next region builds a new team


def test_the_serve_command_sets_it_before_its_parser_loads_torch() -> None:
    code = ("import os; from dynaspec.cli import main as m; import dynaspec.cli.serve_cmd as s; "
            "s.run = lambda a: print(os.environ.get('GOMP_SPINCOUNT')) or 0; "
            "m.main(['serve', '--model', 'default'])")
    out = subprocess.run([sys.executable, "-c", code], env=_env_without_omp(), capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(SERVER_SPIN_COUNT)
