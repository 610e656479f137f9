"""The named choices of every pluggable part: drafters, K policies, quantization modes,
attention backends, linear kernels, execution paths.

Config validation, the CLI's `choices` and help text and the builder all read these tables, so
adding a drafter or a backend is one entry here (plus its module). An entry names its
implementation as "module:attribute" and `load` imports it on demand: the config layer stays
free of torch and of the parts' own imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    name: str
    help: str
    target: str | None = None  # "package.module:attribute"; None for a choice with no part
    user_choice: bool = True  # False: selected internally (not a flag value)


class Registry:
    def __init__(self, kind: str, entries: Iterable[Entry]) -> None:
        self.kind = kind
        self._entries = {e.name: e for e in entries}

    @property
    def names(self) -> tuple[str, ...]:
        """The values a user may give (config fields, CLI choices)."""
        return tuple(n for n, e in self._entries.items() if e.user_choice)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check(self, value: object) -> None:
        """Raise ValueError naming the value and the choices unless it is a user choice."""
        if value not in self.names:
            raise ValueError(f"unknown {self.kind} {value!r}: choose {_or_list(self.names)}")

    def load(self, name: str) -> Any:
        """Import and return the part registered under `name`."""
        entry = self._entries.get(name)
        if entry is None or entry.target is None:
            raise ValueError(f"unknown {self.kind} {name!r}: choose "
                             f"{_or_list([n for n, e in self._entries.items() if e.target])}")
        module, attr = entry.target.split(":")
        return getattr(importlib.import_module(module), attr)

    def help(self) -> str:
        """One line for --help: each user choice with what it means."""
        return "; ".join(f"{e.name}: {e.help}" for e in self._entries.values() if e.user_choice)


def _or_list(names: Iterable[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


SPECULATORS = Registry("speculator", [
    Entry("none", "no drafting"),
    Entry("ngram", "prompt lookup: copy what followed the last n-gram in the context",
          "dynaspec.spec_decode.drafters.drafters:build_ngram"),
    Entry("draft", "a small draft model (--draft-model)",
          "dynaspec.spec_decode.drafters.drafters:build_draft_model"),
    Entry("suffix", "suffix decoding over this request and earlier outputs",
          "dynaspec.spec_decode.drafters.drafters:build_suffix"),
    Entry("eagle", "an EAGLE/EAGLE-3 head on the target's hidden states (--draft-head)",
          "dynaspec.spec_decode.drafters.drafters:build_eagle"),
    Entry("hybrid", "the EAGLE head and a lookup drafter (--eagle-lookup, default suffix) in one "
          "token tree: the lookup's copies where it matches, the head's guesses elsewhere",
          "dynaspec.spec_decode.drafters.drafters:build_hybrid"),
    Entry("oracle", "replay the target's recorded output (--oracle-recording): the ceiling "
          "speculation could reach; bench and tests only, the server refuses it",
          "dynaspec.spec_decode.drafters.oracle:build_oracle"),
])

K_POLICIES = Registry("k_policy", [
    Entry("auto", "table when --k-schedule is given, else goodput"),
    Entry("goodput", "the cost model measured here picks K (a schedule is its ceiling)"),
    Entry("table", "the K schedule as written"),
    Entry("adaptive", "the schedule scaled by observed acceptance"),
])

DTYPES = Registry("dtype", [
    Entry("auto", "bf16"), Entry("bfloat16", "bf16"), Entry("float32", "fp32 (reference)"),
    Entry("float16", "fp16"),
])

DEVICES = Registry("device", [
    Entry("auto", "cuda if available, else cpu"), Entry("cpu", "the CPU"), Entry("cuda", "a GPU"),
])

QUANTIZATIONS = Registry("quantization", [
    Entry("auto", "keep a GGUF's quantized weights quantized, HF weights as they are"),
    Entry("none", "dequantize everything (the reference path)"),
    Entry("int8", "also quantize HF weights to int8 at load"),
    Entry("int4", "also quantize HF weights to int4 at load"),
])

LINEAR_KERNELS = Registry("linear_kernel", [
    Entry("auto", "int8dot where the C++ kernels build here, else torch"),
    Entry("int8dot", "int8 dot products: flat in width and row-invariant"),
    Entry("torch", "torch's int4/int8 kernels plus a bf16 copy for wide steps"),
])

ATTENTION_BACKENDS = Registry("attention backend", [
    Entry("auto", "the in-place CPU kernel when it builds, else eager; gpu_paged on CUDA"),
    Entry("eager", "gather + SDPA for any batch (the reference)",
          "dynaspec.attention.paged:EagerPagedBackend"),
    Entry("cpu_paged", "the in-place C++ paged kernel (an error if it cannot be built)",
          "dynaspec.attention.cpu_paged:CpuPagedBackend"),
    Entry("gpu_paged", "the in-place Triton paged kernel on CUDA (decode, verify, prefill)",
          "dynaspec.attention.gpu_paged:GpuPagedBackend"),
    Entry("uniform", "fixed-shape decode/verify (chosen by the execution plan)",
          "dynaspec.attention.uniform:UniformDecodeBackend", user_choice=False),
])

EXECUTIONS = Registry("execution", [
    Entry("auto", "compiled where the admission table measured it faster"),
    Entry("eager", "never compile"),
    Entry("compiled", "torch.compile / CUDA graphs for every grid shape"),
])

REJECTION_MODES = Registry("rejection_mode", [
    Entry("strict", "lossless verification"),
    Entry("synthetic", "accept drafts at --synthetic-acceptance; NOT lossless"),
])

STRUCTURED_BACKENDS = Registry("structured_output_backend", [
    Entry("xgrammar", "xgrammar token bitmasks",
          "dynaspec.structured.xgrammar_backend:XGrammarBackend"),
])
