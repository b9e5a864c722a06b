"""servescope: an LLM inference engine that shows its work."""

from servescope.config import EngineConfig, ModelConfig, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: importing servescope must not import torch (the CLI's --help stays fast).
    if name == "LLM":
        from servescope.engine.llm import LLM  # lazy: see above
        return LLM
    if name == "LLMEngine":
        from servescope.engine.llm_engine import LLMEngine  # lazy: see above
        return LLMEngine
    if name == "RequestOutput":
        from servescope.engine.outputs import RequestOutput  # lazy: see above
        return RequestOutput
    raise AttributeError(name)
