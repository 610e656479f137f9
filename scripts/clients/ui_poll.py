"""What an open dashboard asks of the server: GET /ui/live once a second (the page's poll;
the playground polls nothing). For the paired check that the page costs the engine nothing
measurable: run it beside a server in one arm of `dynaspec bench served` (same process group, so
the bench stops it with the server), e.g.

  --b "bash -c 'python scripts/clients/ui_poll.py --port 8302 & exec python -m \
       dynaspec.cli.main serve --port 8302 ...'"

It waits for the server to answer, polls until it is gone (or SIGTERM), and prints how many
polls it made and their latency (p50, max) to stderr, so the arm's server log shows the page
really polled through the run. Standard library only.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls (page: 1)")
    p.add_argument("--gone-after", type=float, default=10.0,
                   help="stop after the server has not answered for this long (once it had)")
    args = p.parse_args()
    url = f"http://{args.host}:{args.port}/ui/live"
    latencies: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: (_report(latencies), sys.exit(0)))
    last_ok = None
    while True:
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            latencies.append(time.monotonic() - t0)
            last_ok = t0
        except OSError:
            if last_ok is not None and t0 - last_ok > args.gone_after:
                break
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    _report(latencies)
    return 0


def _report(latencies: list[float]) -> None:
    if latencies:
        s = sorted(latencies)
        print(f"ui_poll: {len(s)} polls of /ui/live, p50 {1e3 * s[len(s) // 2]:.1f} ms, "
              f"max {1e3 * s[-1]:.1f} ms", file=sys.stderr, flush=True)
    else:
        print("ui_poll: no poll answered", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
