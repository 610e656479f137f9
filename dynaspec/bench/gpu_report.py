"""The closing table of a gpu_check run (dynaspec/bench/gpu_check.py), read from its report."""

from __future__ import annotations


def summary(report: dict) -> str:
    st = report["stages"]
    lines = [f"gpu_check: {report.get('elapsed_s')} s"]
    env = st.get("env", {}).get("result", {})
    lines.append(f"device {env.get('device')}, torch {env.get('torch')}, HBM copy "
                 f"{env.get('hbm_copy_GBps')} GB/s")
    lines.append(f"tests: {st.get('tests', {}).get('result', {}).get('summary')}")
    ours = st.get("ours", {}).get("result", {})
    peer = []
    for k in ("hf", "hf_compile"):
        peer += [x for x in st.get(k, {}).get("result", {}).get("results", [])
                 if "tokens_per_s" in x]
    if isinstance(ours.get("graphs"), list):
        from dynaspec.bench.hf_peer import side_by_side

        lines.append(side_by_side(ours["graphs"], peer))
    for k in ("eager_b1", "verify_b1_ctx128", "launch_floor", "broken_shapes"):
        if k in ours:
            v = ours[k]
            if k == "eager_b1" and isinstance(v, dict) and "eager_over_graph" in v:
                v = {"eager_over_graph": v["eager_over_graph"], "step_ms": v.get("step_ms")}
            if k == "verify_b1_ctx128" and isinstance(v, dict) and "ratio_to_width_1" in v:
                v = v["ratio_to_width_1"]
            lines.append(f"{k}: {v}")
    real = st.get("real", {}).get("result", {})
    for k, v in real.items():
        if k.startswith(("ngram_over", "greedy_identical", "skipped")):
            lines.append(f"real {k}: {v}")
    return "\n".join(lines)
