#!/usr/bin/env bash
# The C++ CPU kernels on this machine's CPU, in about two minutes on 16 cores: prints the CPU's
# model and flags and the kernel paths dynaspec selects for them, builds the kernels afresh (a
# JIT build with torch's tooling; a direct compiler build where ninja is missing), builds them a
# second time against SIMDe (dynaspec/kernel_emulation.py: every ISA path, emulated; needs
# libsimde-dev), and runs every kernel test file: path selection and build facts, int8 dot
# products, attention (paths, trees), fused ops, the layer stack, each ISA path natively where
# this CPU has it and emulated everywhere (the pytest summary and the JSON say which ran how).
# Nothing is installed and the checkout
# is not written to: the package and tests are copied to a temporary directory and used from
# PYTHONPATH. No network. With $OUT set, a short JSON summary goes to $OUT/cpu_kernels.json.
# Usage: scripts/cpu_kernel_check.sh [--as avx2|avx_vnni]   (PYTHON=... picks the interpreter;
# BUILD_TIMEOUT and TEST_TIMEOUT, in seconds, default 300 and 240, for a slower machine;
# KERNEL_BUILD=direct builds as when ninja is missing; CHECK_DIR=dir works there and keeps it, so
# a second run reuses its builds)
# --as runs it all as an AVX2-only (a Zen 3's flags) or an AVX-VNNI machine (an Alder Lake's)
# would: $DYNASPEC_CPU_FLAGS (dynaspec/cpu_features.py) masks this CPU's flags, so the build and
# the paths selected are an AVX2 machine's, the paths the mask withholds run emulated, and the
# summary says what the masked machine itself selects (its avx_vnni is emulated on a CPU without
# it). Flags can only be withheld, never added: nothing runs that this CPU lacks.
set -u
AS=""
if [ "${1:-}" = "--as" ]; then
  case "${2:-}" in
    avx2) AS=zen3 ;;
    avx_vnni) AS=alder_lake ;;
    *) echo "usage: $0 [--as avx2|avx_vnni]" >&2; exit 2 ;;
  esac
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [ -n "${CHECK_DIR:-}" ]; then
  WORK="$CHECK_DIR"
  rm -rf "$WORK/src"
else
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/dynaspec-cpu-check.XXXXXX")"
fi
START=$(date +%s)
mkdir -p "$WORK/src"
cp -r "$ROOT/dynaspec" "$ROOT/tests" "$ROOT/pyproject.toml" "$WORK/src/"
find "$WORK/src" -name "_cpu_kernels*.so" -delete  # a module built elsewhere: this run builds its own
cd "$WORK/src" || exit 1
export PYTHONPATH="$WORK/src" DYNASPEC_CACHE_DIR="$WORK/cache" PYTHONDONTWRITEBYTECODE=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -n "$AS" ]; then
  DYNASPEC_CPU_FLAGS="$("$PY" -c "from tests.unit.recorded_cpus import CPUS; print(CPUS['$AS'])")"
  export DYNASPEC_CPU_FLAGS
fi

echo "== CPU"
grep -m1 "model name" /proc/cpuinfo
grep -m1 "^flags" /proc/cpuinfo
"$PY" - <<'EOF'
from dynaspec import cpu_features as cf
sel = cf.select(cf.cpu_flags())
if cf.masked_as() is not None:
    print(f"masked by {cf.MASK_ENV}: that CPU selects",
          ", ".join(f"{k}={v}" for k, v in cf.masked_as().chosen.items()))
print("vector flags:", " ".join(sorted(f for f in sel.flags if f.startswith(("avx", "amx", "fma", "f16c")))))
print("selected:", ", ".join(f"{k}={v}" for k, v in sel.chosen.items()))
print("compiler options:", " ".join(sel.compiler_options()) or "(none)")
EOF

echo "== build"
if [ -n "${KERNEL_BUILD:-}" ]; then
  BUILD="$KERNEL_BUILD"  # jit or direct, to try one
elif "$PY" -c "import torch.utils.cpp_extension as c, sys; sys.exit(0 if c.is_ninja_available() else 1)"; then
  BUILD=jit
else
  BUILD=direct  # no ninja: compile the install-time module by hand, which cpu_kernels then loads
fi
echo "build: $BUILD"
timeout "${BUILD_TIMEOUT:-300}" "$PY" - "$BUILD" <<'EOF' 2>&1 | tee "$WORK/build.log"
import inspect, json, logging, os, re, subprocess, sys, sysconfig, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
import torch
from torch.utils import cpp_extension as ce
from dynaspec import cpu_kernels as ck

t0 = time.perf_counter()
if sys.argv[1] == "direct":
    tag, _ = ck.isa_flags()
    objs, procs = [], []
    # the C++ standard torch's own extension builds use (its headers may need it)
    std = max(re.findall(r"-std=c\+\+(\d+)", inspect.getsource(ce)) or ["17"], key=int)
    flags = ["-fPIC", f"-std=c++{std}", "-DTORCH_EXTENSION_NAME=_cpu_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             *[f"-I{p}" for p in ce.include_paths()], f"-I{sysconfig.get_paths()['include']}",
             *ck.compile_flags(tag)]
    for s in ck.SOURCES:
        obj = os.path.join(os.environ["DYNASPEC_CACHE_DIR"], s + ".o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        objs.append(obj)
        procs.append(subprocess.Popen(["c++", *flags, "-c", os.path.join(ck._CSRC, s), "-o", obj]))
    if any(p.wait() for p in procs):
        sys.exit("direct build failed")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    out = os.path.join("dynaspec", "_cpu_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.check_call(["c++", "-shared", *objs, "-o", out, f"-L{lib}", f"-Wl,-rpath,{lib}",
                           "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-fopenmp"])
ok, why = ck.available()
seconds = time.perf_counter() - t0
ext = ck.extension() if ok else None
facts = {"ok": ok, "why": why, "how": sys.argv[1], "seconds": round(seconds, 1),
         "build_info": list(ext.build_info()) if ext else None,
         "paths_in_kernel": list(ext.cpu_paths()) if ext and hasattr(ext, "cpu_paths") else None,
         "selected": ck.selection().chosen}
print("kernels:", "built" if ok else f"NOT available: {why}", f"in {seconds:.0f} s")
if not ok and sys.argv[1] == "jit":  # the compiler's own words: ninja again in the build folder
    where = ck.build_dir(ck.isa_flags()[0])
    out = subprocess.run(["ninja", "-C", where], capture_output=True, text=True).stdout.splitlines()
    errors = [i for i, line in enumerate(out) if "error" in line or "FAILED" in line]
    shown = sorted({j for i in errors[:12] for j in range(max(0, i - 2), min(len(out), i + 3))})
    facts_errors = [out[j][:400] for j in shown]
    print("\n".join(facts_errors[:80]))
else:
    facts_errors = []
facts["errors"] = facts_errors[:80]
json.dump(facts, open(os.path.join(os.environ["DYNASPEC_CACHE_DIR"], "..", "build.json"), "w"))
EOF

echo "== emulated build (SIMDe)"
timeout "${BUILD_TIMEOUT:-300}" "$PY" - <<'EOF' 2>&1 | tee -a "$WORK/build.log"
import logging, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from dynaspec import kernel_emulation as ke
t0 = time.perf_counter()
ok, why = ke.available()
print("emulated kernels:", "built" if ok else f"NOT available: {why}", f"in {time.perf_counter() - t0:.0f} s")
EOF

echo "== tests"
CONF=""
"$PY" -c "import hypothesis" 2>/dev/null || CONF="--noconftest"  # the kernel tests need no fixtures
TESTS="tests/unit/test_cpu_features.py tests/unit/test_cpu_kernels_build.py tests/model/test_int8_dot.py \
tests/unit/test_kernel_paths.py tests/unit/test_cpu_paged_attention.py tests/unit/test_cpu_paged_paths.py \
tests/unit/test_cpu_paged_tree.py tests/unit/test_fused_ops.py tests/unit/test_kernel_emulation.py \
tests/model/test_layer_stack.py"
export DYNASPEC_KERNEL_PATHS_OUT="$WORK/kernel_paths.json"  # tests/conftest.py: how each path ran
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -rs -p no:cacheprovider $CONF --junitxml="$WORK/junit.xml" $TESTS 2>&1 \
  | tee "$WORK/pytest.log" | tail -40
RC=${PIPESTATUS[0]}

"$PY" - "$WORK" "$RC" "$(( $(date +%s) - START ))" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
from dynaspec import cpu_features as cf
work, rc, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
sel = cf.select(cf.cpu_flags())
summary = {"cpu": model, "masked_as": cf.masked_as().chosen if cf.masked_as() else None,
           "vector_flags": sorted(f for f in sel.flags if f.startswith(("avx", "amx", "fma", "f16c"))),
           "selected": sel.chosen, "pytest_exit": rc, "seconds": seconds}
try:
    summary["build"] = json.load(open(os.path.join(work, "build.json")))
except OSError:
    summary["build"] = {"ok": False, "why": "the build step did not finish (see its output)"}
counts, failed, skipped = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, [], {}
try:
    for case in ET.parse(os.path.join(work, "junit.xml")).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            kind = "failed" if case.find("failure") is not None else "errors"
            counts[kind] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            why = case.find("skipped").get("message", "")
            skipped[why] = skipped.get(why, 0) + 1
        else:
            counts["passed"] += 1
except (OSError, ET.ParseError) as exc:
    summary["junit"] = f"unreadable: {exc}"
summary.update(tests=counts, failed=failed[:40], skip_reasons=skipped)
try:  # per kernel path: native, emulated, both, or not run (tests/conftest.py)
    summary["kernel_paths"] = json.load(open(os.path.join(work, "kernel_paths.json")))
except (OSError, ValueError):
    summary["kernel_paths"] = "not recorded (pytest ran without tests/conftest.py)"
# green only where the kernels built (else every kernel test skipped) and no test failed
summary["ok"] = bool(summary["build"].get("ok")) and rc == 0 and counts["passed"] > 0
print(json.dumps(summary, indent=1))
if os.environ.get("OUT"):
    os.makedirs(os.environ["OUT"], exist_ok=True)
    with open(os.path.join(os.environ["OUT"], "cpu_kernels.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("wrote", os.path.join(os.environ["OUT"], "cpu_kernels.json"))
print("CPU KERNEL CHECK:", "OK" if summary["ok"] else "FAILED")
sys.exit(0 if summary["ok"] else 1)
EOF
STATUS=$?
[ -n "${CHECK_DIR:-}" ] || rm -rf "$WORK"
exit "$STATUS"
