"""Shared helpers for end-to-end tests: engines on tiny checkpoints and the near-tie rule."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from dynaspec import LLM, SamplingParams
from dynaspec.config import EngineConfig
from dynaspec.engine.builder import build_engine_parts
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.spec_decode.drafters.base import Proposer

NEAR_TIE = 1e-4


@functools.lru_cache(maxsize=8)
def _reference_llm(model: str) -> LLM:
    return LLM(model=model, dtype="float32", enable_prefix_caching=False, num_kv_blocks=256)


def last_logits(model: str, token_ids: list[int]) -> torch.Tensor:
    """Logits after `token_ids`, from one plain prefill of a reference fp32 engine."""
    llm = _reference_llm(model)
    eng = llm.engine
    from dynaspec.attention.backend import AttentionBatch

    n = len(token_ids)
    blocks = list(range((n + 15) // 16))
    m = eng.parts.model
    md = m.attn.build_metadata(
        AttentionBatch([n], [n], [blocks], eng.parts.kv.block_size, torch.device("cpu"))
    )
    return m.forward(torch.tensor(token_ids), torch.arange(n), eng.runner.kv_caches, md,
                     torch.tensor([n - 1]))[0]


def assert_greedy_equal(model: str, prompt_ids: list[int], ref: list[int], got: list[int],
                        label: str = "") -> None:
    """Token-exact, except a divergence at a near tie of the reference's top-2 logits
    (docs/design.md §9)."""
    if ref == got:
        return
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if i >= min(len(ref), len(got)):
        raise AssertionError(
            f"{label}: lengths differ ({len(ref)} vs {len(got)}) with equal prefix"
        )
    logits = last_logits(model, prompt_ids + ref[:i])
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    if gap >= NEAR_TIE:
        raise AssertionError(f"{label}: diverged at output token {i}: {ref[i]} vs {got[i]}; "
                             f"reference top-2 gap {gap:.3g} is not a near tie")
    print(f"NEAR TIE {label}: diverged at token {i}, top-2 gap {gap:.2e} (allowed)")


def llm_drafting_with(wrap: Callable[[Proposer], Proposer], model: str, **engine_args) -> LLM:
    """An LLM whose drafter is `wrap(the configured drafter)`, injected as the engine is built
    (the policy and the runner see the same drafter)."""
    config = EngineConfig.from_kwargs(model=model, **engine_args)
    return LLM.of(LLMEngine(config, build_engine_parts(config, wrap_proposer=wrap)))


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 60,
                   repetitive: bool = False) -> list[list[int]]:
    """Mixed-length prompts; `repetitive` ones repeat a phrase so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        if repetitive:
            phrase = torch.randint(3, vocab, (max(2, length // 3),), generator=g).tolist()
            out.append((phrase * 4)[:length] if length > 4 else phrase)
        else:
            out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


@pytest.fixture
def check_integrity():
    engines: list = []
    yield engines.append
    for eng in engines:
        eng.check_integrity()


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """A tiny random draft sharing tiny_llama's vocabulary but not its weights (near-0%
    acceptance)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("tiny_draft"))
    for name in os.listdir(tiny_llama_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama_dir, name), out)
    path = os.path.join(tiny_llama_dir, "model.safetensors")
    g = torch.Generator().manual_seed(99)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.5 if v.dim() == 2 else v)
          for k, v in load_file(path).items()}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def watch_steps(llm) -> list:
    """Record every step's (StepPlan, RunnerOutput) as the engine runs it."""
    seen, orig = [], llm.engine.runner.run

    def run(prepared):
        res = orig(prepared)
        seen.append((prepared.out, res))
        return res

    llm.engine.runner.run = run
    return seen
