"""The `fuzz` reliability scenario: schemathesis against the server's own /openapi.json.

Cases are generated from the published request bodies (positive: valid by the schema, so most
reach the engine; negative: broken on purpose, so validation is exercised too), the model name
is set to the served one in positive cases (a random one is only a 404), and they are sent from
a few threads so the engine batches them. Checks: no 5xx, every 4xx body is an OpenAI error
object, the engine ran at least `min_reached` of them (HTTP 200), and afterwards a normal
request still answers and the KV pool is whole.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynaspec.extras import require

OPERATIONS = ("/v1/completions", "/v1/chat/completions")


def generate_cases(url: str, num_cases: int, seed: int, negative_share: float = 0.15) -> list:
    """`num_cases` schemathesis cases over both POST operations, deterministic for a seed."""
    schemathesis = require("schemathesis", "bench", "the fuzz scenario")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from dynaspec.bench.fuzz_formats import register

    register()  # generators for the grammar formats the schema declares
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    modes = schemathesis.GenerationMode
    cases: list = []
    n_neg = int(num_cases * negative_share)
    plan = [(op, modes.POSITIVE, (num_cases - n_neg) // len(OPERATIONS)) for op in OPERATIONS]
    plan += [(op, modes.NEGATIVE, n_neg // len(OPERATIONS)) for op in OPERATIONS]
    for i, (path, mode, count) in enumerate(plan):
        if count < 1:
            continue
        strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
        batch: list = []

        @hseed(seed * 100 + i)
        @settings(max_examples=count, phases=[Phase.generate], database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def collect(case: Any) -> None:  # run at once, inside this iteration
            batch.append((case, mode is modes.POSITIVE))  # noqa: B023

        collect()
        cases.extend(batch[:count])
    return cases


def _is_openai_error(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] != ""
            and isinstance(err.get("type"), str) and "param" in err and "code" in err)


def send_cases(url: str, model: str, cases: list, seed: int, workers: int = 32,
               timeout_s: float = 120.0) -> dict:
    """Send the cases; count outcomes. Bounded: one call per case, each with a timeout."""
    rng = random.Random(seed)
    for case, positive in cases:
        # Positive bodies name the served model; a share of negative ones do too, so their
        # other defects get past the model check.
        if isinstance(case.body, dict) and (positive or rng.random() < 0.5):
            case.body["model"] = model

    def one(item: tuple) -> tuple[int, bool, str]:
        case, _ = item
        try:
            resp = case.call(base_url=url, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a transport failure is a finding, not a crash
            return 0, False, f"{type(exc).__name__}: {exc}"
        code, text = resp.status_code, resp.text or ""
        stream_error = code == 200 and "data: {\"error\"" in text
        ok = (code == 200 and not stream_error) or (400 <= code < 500 and _is_openai_error(text))
        return code, ok, "" if ok else f"{code} {text[:300]}"

    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(one, cases))
    by_status: dict[str, int] = {}
    for code, _, _ in outcomes:
        by_status[str(code)] = by_status.get(str(code), 0) + 1
    # The reason first: a long body would otherwise push it past the example's cut.
    bad = [
        (why, c.operation.path, c.body) for (c, _), (_, ok, why) in zip(cases, outcomes) if not ok
    ]
    return {"sent": len(cases), "by_status": dict(sorted(by_status.items())),
            "reached_engine": by_status.get("200", 0),
            "server_errors": sum(n for s, n in by_status.items() if s.startswith("5") or s == "0"),
            "bad_responses": len(bad), "bad_examples": [repr(b)[:500] for b in bad[:5]]}


def run_fuzz(server: Any, num_requests: int, seed: int) -> dict:
    """The scenario on a started LocalServer; `num_requests` is the least that must reach the
    engine (cases are generated in rounds until then, at most 4 rounds)."""
    t0 = time.monotonic()
    totals: dict = {"sent": 0, "reached_engine": 0, "server_errors": 0, "bad_responses": 0,
                    "by_status": {}, "bad_examples": []}
    for rnd in range(4):
        if totals["reached_engine"] >= num_requests:
            break
        missing = num_requests - totals["reached_engine"]
        cases = generate_cases(server.url, max(200, int(missing * 1.6)), seed + rnd)
        part = send_cases(server.url, server.model_name, cases, seed + rnd)
        for key in ("sent", "reached_engine", "server_errors", "bad_responses"):
            totals[key] += part[key]
        for status, n in part["by_status"].items():
            totals["by_status"][status] = totals["by_status"].get(status, 0) + n
        totals["bad_examples"] += part["bad_examples"][: 5 - len(totals["bad_examples"])]
    after = server.normal_request()
    totals.update(server.leak_report())
    totals["normal_request_after"] = after
    totals["seconds"] = round(time.monotonic() - t0, 1)
    totals["checks"] = {
        f"reached_engine >= {num_requests}": totals["reached_engine"] >= num_requests,
        "0 server errors (5xx)": totals["server_errors"] == 0,
        "every 4xx body is an OpenAI error": totals["bad_responses"] == 0,
        "a normal request answers afterwards": after == "ok",
        "no leaked blocks or request state": totals["leaks"] == {},
    }
    return totals
