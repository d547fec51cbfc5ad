"""deltaserve: a serving engine for Qwen3.5 hybrid models with an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling_params import SamplingParams


def __getattr__(name: str):  # imports torch only when the engine is used
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deltaserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
