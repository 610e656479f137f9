#!/usr/bin/env bash
# Fuzz a running dynaspec server's published API (/openapi.json) with schemathesis 4.x.
# A fixed copy of ../shared/clients/fuzz.sh: its hooks (fuzz_hooks.py here) also cap
# whole-number float token counts (`max_tokens: 2047.0` is an integer to the schema and the server;
# the shared hooks let one generate 2,047 tokens), apply the cross-field rules JSON Schema cannot
# state, and register generators for the grammar formats /openapi.json declares; and it reads the
# served max_model_len (FUZZ_MAX_MODEL_LEN) and runs with this checkout's dynaspec on PYTHONPATH.
# It also counts generation requests (POST 200 on /v1/*completions) apart from /tokenize.
# All operations, all checks (not_a_server_error, status/content-type/schema conformance,
# negative_data_rejection, positive_data_acceptance, ...), a bounded number of examples.
# Generation is capped by fuzz_hooks.py (max_tokens <= FUZZ_MAX_TOKENS) so valid cases stay cheap.
# --output-sanitize false: schemathesis otherwise prints "[Filtered]" for every *token* field
# (max_tokens, stop_token_ids), which makes its curl repro lines useless here.
#
#   URL=http://127.0.0.1:8123 MAX_EXAMPLES=20 scripts/clients/fuzz.sh
#
# Env: URL (default http://127.0.0.1:8000), MAX_EXAMPLES per operation (20), CHECKS (all),
#      PHASES (examples,coverage,fuzzing; add stateful to run it: it ignores MAX_EXAMPLES and
#      runs until MAX_TIME), SEED (1), WORKERS (1), MAX_TIME (120 s for the whole run),
#      RATE_LIMIT (5/s; empty = none), FUZZ_MAX_TOKENS (2), FUZZ_MODEL (model pinned into string
#      `model` fields; default the first id of /v1/models; FUZZ_MODEL= (empty) fuzzes `model` too,
#      which then stops most cases at the 404 model check), SCHEMATHESIS (binary; default
#      `schemathesis`, which dynaspec's [test] extra installs), OUT_DIR (default mktemp),
#      NICE ("nice -n 19"), EXTRA (more schemathesis flags).
# Bound: schemathesis 4.32's fuzzing phase did not stop at MAX_EXAMPLES here (5,810 cases in
#      150 s at -n 20), so MAX_TIME x RATE_LIMIT is the real cap on requests (~600 by default).
# Prints: requests made (by operation and status), every 5xx with its request, schemathesis' verdict.
# Exit code: schemathesis' (non-zero when any check failed).
set -uo pipefail
URL=${URL:-http://127.0.0.1:8000}
MAX_EXAMPLES=${MAX_EXAMPLES:-20}
CHECKS=${CHECKS:-all}
PHASES=${PHASES:-examples,coverage,fuzzing}   # stateful ignores --max-examples: runs to MAX_TIME
SEED=${SEED:-1}
WORKERS=${WORKERS:-1}
MAX_TIME=${MAX_TIME:-120}
# ${RATE_LIMIT-...}, not :-: the shared copy's :- turned the documented "RATE_LIMIT= (empty)
# for no limit" back into 5/s.
RATE_LIMIT=${RATE_LIMIT-5/s}   # schemathesis --rate-limit; RATE_LIMIT= (empty) for no limit
SCHEMATHESIS=${SCHEMATHESIS:-schemathesis}
NICE=${NICE:-nice -n 19}
OUT_DIR=${OUT_DIR:-$(mktemp -d /tmp/fuzz-run.XXXXXX)}
mkdir -p "$OUT_DIR"
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)   # fuzz_hooks imports dynaspec.bench.fuzz_formats from here
command -v "$SCHEMATHESIS" >/dev/null || { echo "fuzz.sh: '$SCHEMATHESIS' not found; pip install 'schemathesis>=4,<5'" >&2; exit 2; }
curl -sf "$URL/openapi.json" -o "$OUT_DIR/openapi.json" || { echo "fuzz.sh: no $URL/openapi.json" >&2; exit 2; }
export FUZZ_LOG="$OUT_DIR/requests.jsonl"; : > "$FUZZ_LOG"
if [ -z "${FUZZ_MODEL+x}" ]; then
  FUZZ_MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null || true)
fi
export FUZZ_MODEL
FUZZ_MAX_MODEL_LEN=${FUZZ_MAX_MODEL_LEN:-$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0].get("max_model_len") or "")' 2>/dev/null || true)}
export FUZZ_MAX_MODEL_LEN
echo "fuzz.sh: $URL, max-examples $MAX_EXAMPLES, checks $CHECKS, phases $PHASES, seed $SEED, workers $WORKERS, max-time $MAX_TIME s, rate limit '${RATE_LIMIT:-none}', model pinned to '${FUZZ_MODEL}', max_model_len '${FUZZ_MAX_MODEL_LEN}'; artifacts in $OUT_DIR/"
cd "$OUT_DIR"   # hypothesis' example database (.hypothesis/) lands here, not in the caller's tree
PYTHONPATH="$HERE:$REPO${PYTHONPATH:+:$PYTHONPATH}" SCHEMATHESIS_HOOKS=fuzz_hooks \
  $NICE "$SCHEMATHESIS" run "$URL/openapi.json" --url "$URL" \
  --checks "$CHECKS" --phases "$PHASES" --max-examples "$MAX_EXAMPLES" --seed "$SEED" \
  --workers "$WORKERS" --max-time "$MAX_TIME" --request-timeout 120 --continue-on-failure --no-shrink \
  ${RATE_LIMIT:+--rate-limit "$RATE_LIMIT"} --no-color --output-sanitize false --report junit --report-dir "$OUT_DIR/report" ${EXTRA:-} > "$OUT_DIR/schemathesis.log" 2>&1
rc=$?
python3 - "$FUZZ_LOG" <<'PY'
import json, sys, collections
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = collections.Counter((r["method"] + " " + r["path"].split("?")[0] if not r["path"].startswith("/v1/models/") else r["method"] + " /v1/models/{id}", r["status"]) for r in recs)
print(f"== requests made: {len(recs)}")
ops = collections.defaultdict(dict)
for (op, st), n in by.items(): ops[op][st] = n
for op in sorted(ops): print(f"  {op:28s} " + " ".join(f"{st}:{n}" for st, n in sorted(ops[op].items())))
five = [r for r in recs if r["status"] >= 500]
print(f"== 5xx responses: {len(five)}")
for r in five[:20]: print("  ", json.dumps(r)[:900])
ok = sum(1 for r in recs if r["method"] == "POST" and r["status"] == 200)
print(f"== POST 200 (all operations): {ok}")
gen = sum(1 for r in recs if r["method"] == "POST" and r["status"] == 200
          and r["path"].split("?")[0] in ("/v1/completions", "/v1/chat/completions"))
print(f"== generation requests that succeeded (POST 200 on /v1/completions, /v1/chat/completions): {gen}")
slow = sorted(recs, key=lambda r: -r["elapsed_s"])[:3]
print("== slowest:", ", ".join(f'{r["method"]} {r["path"][:40]} {r["status"]} {r["elapsed_s"]}s' for r in slow))
PY
echo "== schemathesis verdict (tail of $OUT_DIR/schemathesis.log):"
sed -n '/SUMMARY\|Summary/,$p' "$OUT_DIR/schemathesis.log" | tail -40
[ -s "$OUT_DIR/schemathesis.log" ] && ! grep -q -i "summary" "$OUT_DIR/schemathesis.log" && tail -25 "$OUT_DIR/schemathesis.log"
echo "fuzz.sh: schemathesis exit code $rc"
exit $rc
