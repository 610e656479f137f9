"""bench/served_probe.py: histogram means over a run from two scrapes, families by suffix, and
the CPU seconds of a process group's threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dynaspec.bench.served_probe import cpu_seconds, family, histogram_means


def test_histogram_means_are_taken_over_the_interval_only():
    before = {'vllm:time_to_first_token_seconds_sum{model_name="m"}': 10.0,
              'vllm:time_to_first_token_seconds_count{model_name="m"}': 5.0,
              'vllm:e2e_request_latency_seconds_sum{model_name="m"}': 1.0,
              'vllm:e2e_request_latency_seconds_count{model_name="m"}': 1.0}
    after = {'vllm:time_to_first_token_seconds_sum{model_name="m"}': 13.0,
             'vllm:time_to_first_token_seconds_count{model_name="m"}': 15.0,
             'vllm:e2e_request_latency_seconds_sum{model_name="m"}': 1.0,
             'vllm:e2e_request_latency_seconds_count{model_name="m"}': 1.0,
             'vllm:num_requests_running{model_name="m"}': 0.0}
    assert histogram_means(before, after) == {"time_to_first_token_seconds": 0.3}


def test_family_sums_by_label_and_matches_the_name_after_the_prefix():
    s = {'dynaspec:request_success_total{model_name="m",finished_reason="abort"}': 2.0,
         'dynaspec:request_success_total{model_name="m",finished_reason="length"}': 7.0,
         'dynaspec:xrequest_success_total{finished_reason="length"}': 100.0}
    assert family(s, "request_success_total", "finished_reason") == {"abort": 2.0, "length": 7.0}
    assert family(s, "request_success_total") == {"": 9.0}


def test_cpu_seconds_of_a_busy_child_group():
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n" \
           "time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while sum(cpu_seconds(proc.pid).values()) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        got = cpu_seconds(proc.pid)
        assert sum(got.values()) >= 0.5, got
        assert all("/" in k for k in got) and cpu_seconds(os.getpgrp() + 10**7) == {}
    finally:
        proc.kill()
        proc.wait()
