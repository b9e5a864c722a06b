"""servescope.sampling: the per-step Sampler (penalties, temperature, top-k/p, min-p, logprobs) and stop strings."""

from servescope.sampling.filters import apply_top_k_top_p_min_p
from servescope.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingState,
    TokenLogprobs,
    make_generator,
)
from servescope.sampling.stop import StopChecker, check_stop_strings, find_stop_string, max_stop_holdback

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingState",
    "TokenLogprobs",
    "make_generator",
    "apply_top_k_top_p_min_p",
    "StopChecker",
    "check_stop_strings",
    "find_stop_string",
    "max_stop_holdback",
]
