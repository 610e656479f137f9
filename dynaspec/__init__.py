"""dynaspec: an LLM inference engine built around dynamic speculative decoding."""

from dynaspec.config import EngineConfig
from dynaspec.sampling_params import SamplingParams
from dynaspec.structured_params import StructuredOutputParams


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; import it lazily so `dynaspec --help` stays fast.
    if name == "LLM":
        from dynaspec.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "EngineConfig"]
