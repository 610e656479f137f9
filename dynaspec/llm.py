"""Offline facade: `LLM(model=..., **engine_args).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.engine.sync_driver import generate
from dynaspec.outputs import RequestOutput
from dynaspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dynaspec.dp.front_end import DPEngine


class LLM:
    def __init__(self, model: str = "default", **engine_args) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if config.parallel.data_parallel_size > 1 or config.parallel.engine_process:  # dynaspec/dp
            from dynaspec.dp.front_end import DPEngine
            self.engine: LLMEngine | DPEngine = DPEngine(config)
        else:
            self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def of(cls, engine: LLMEngine) -> LLM:
        """The facade over an engine built elsewhere (parts injected, as a test's drafter is:
        `build_engine_parts(config, wrap_proposer=...)`)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def shutdown(self) -> None:
        """Stop data-parallel ranks now (otherwise at interpreter exit); a no-op without DP."""
        self.engine.shutdown()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        return generate(self.engine, list(prompts), list(sampling_params))
