"""Schemathesis hooks used by scripts/clients/fuzz.sh (loaded through
SCHEMATHESIS_HOOKS=fuzz_hooks).

A fixed copy of ../shared/clients/fuzz_hooks.py. What it changes in a generated body, and why:

- Generation is capped so valid cases stay cheap on a CPU server: `max_tokens` /
  `max_completion_tokens` above FUZZ_MAX_TOKENS (default 2) is lowered to it, **whole-number
  floats included** (`2047.0` is an integer by JSON Schema and by the server; the shared copy
  capped only Python ints, so one `max_tokens: 2047.0` generated 2,047 tokens in 49 s and
  tripped the response-time check); null is dropped and a body with neither gets the cap.
  Invalid values (0, -1, 1.5, strings, above the schema's maximum of max_model_len - 1) are
  left alone, so validation is still exercised and no invalid case is made valid (schemathesis
  does not re-validate a body after this hook).
- A string `model` becomes $FUZZ_MODEL (the served model), else almost every case stops at the
  404 model check and generation is never reached.
- Rules between fields that JSON Schema cannot state (the schema's descriptions state them;
  the server answers 400 when they are broken), applied so "valid by the schema" means valid:
  a named `tool_choice` names one of `tools` (renamed to the first tool); tool names are unique
  (a suffix is added to repeats); a token-id prompt plus the token cap fits the context
  ($FUZZ_MAX_MODEL_LEN: the prompt's ids are cut at the end). Positive cases only: a negative
  case keeps whatever it breaks.
- The grammar string formats the schema declares (`xgrammar-ebnf`, `json-schema-text`) get
  generators (dynaspec/bench/fuzz_formats.py), as OpenAPI intends for custom formats.

after_call: appends one JSON line per request (method, path, status, the response time
schemathesis measured, body excerpt for 5xx) to $FUZZ_LOG, which fuzz.sh summarises.
"""
import json
import os
import time

import schemathesis

from dynaspec.bench.fuzz_formats import register

CAP = int(os.environ.get("FUZZ_MAX_TOKENS", "2"))
MODEL = os.environ.get("FUZZ_MODEL", "")
CTX = int(os.environ.get("FUZZ_MAX_MODEL_LEN", "0") or 0)
LOG = os.environ.get("FUZZ_LOG", "fuzz_requests.jsonl")
GENERATE = ("/v1/completions", "/v1/chat/completions")
_t0 = {}
register()


def _count(v):
    """A token count as the server reads it (ints and whole-number floats), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return int(v)
    return None


def _cap_tokens(body):
    keys = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    for k in ("max_tokens", "max_completion_tokens"):
        if k in body and body[k] is None:  # null means "up to the context length": minutes
            del body[k]
    for k in keys:
        n = _count(body[k])
        if n is not None and CAP < n < (CTX or n + 1):
            body[k] = CAP
    if not keys:
        body["max_tokens"] = CAP


def _tool_rules(body):
    tools = body.get("tools")
    fns = (
        [
            t["function"]
            for t in tools
            if isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
        ]
        if isinstance(tools, list)
        else []
    )
    seen = set()
    for i, fn in enumerate(fns):
        if fn["name"] in seen:
            fn["name"] = f"{fn['name'][:58]}_{i}"
        seen.add(fn["name"])
    choice = body.get("tool_choice")
    if fns and isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        choice["function"]["name"] = fns[0]["name"]


def _fit_prompt(body):
    prompt, limit = body.get("prompt"), _count(body.get("max_tokens"))
    if not CTX or not isinstance(prompt, list) or limit is None or limit < 1:
        return
    room = CTX - limit
    if prompt and all(isinstance(p, list) for p in prompt):
        for p in prompt:
            del p[room:]
    elif prompt and not any(isinstance(p, (str, list)) for p in prompt):
        del prompt[room:]


def _positive(case):
    meta = getattr(case, "meta", None)
    mode = getattr(getattr(meta, "generation", None), "mode", None)
    return mode is None or bool(getattr(mode, "is_positive", True))


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if isinstance(body, dict):
        if MODEL and isinstance(body.get("model"), str):
            body["model"] = MODEL
    # Generation bodies only: a max_tokens added to a /tokenize body is an unknown field (the
    # shared copy added it to every body, so no /tokenize or /detokenize case was ever valid).
    if isinstance(body, dict) and case.path in GENERATE:
        _cap_tokens(body)
        if _positive(case):
            _tool_rules(body)
            _fit_prompt(body)
    _t0[id(case)] = time.monotonic()


@schemathesis.hook
def after_call(context, case, response):
    # The server's answer time as schemathesis measured it (its response-time check reads the
    # same); the wall time since before_call is the fallback (with workers it can mix up cases).
    t0 = _t0.pop(id(case), None)
    elapsed = getattr(response, "elapsed", None)
    if not isinstance(elapsed, (int, float)):
        elapsed = time.monotonic() - t0 if t0 is not None else 0.0
    rec = {"method": case.method, "path": case.formatted_path, "status": response.status_code,
           "elapsed_s": round(elapsed, 3)}
    if response.status_code >= 500:
        rec["request_body"] = (
            json.dumps(case.body, default=str)[:600] if case.body is not None else None
        )
        rec["response"] = response.text[:600]
    with open(LOG, "a") as f:
        f.write(json.dumps(rec) + "\n")
