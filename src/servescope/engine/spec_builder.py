"""Builds the speculative decoder an EngineConfig asks for: the proposer and the k chooser."""

from __future__ import annotations

from typing import Optional

from servescope.config import EngineConfig
from servescope.engine.spec_decode import SpecDecoder
from servescope.engine.step_cost import StepCostPredictor
from servescope.spec.adaptive import KChooser
from servescope.spec.ngram import NgramProposer


def build_spec_decoder(config: EngineConfig, loaded, runner, sampler, cost: Optional[StepCostPredictor],
                       max_model_len: int) -> Optional[SpecDecoder]:
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.speculative_method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        propose_seconds = lambda k: 0.0  # noqa: E731 (host work of microseconds)
    else:
        # a true cycle: the draft proposer is built from engine parts (a runner on its own KV cache)
        from servescope.engine.draft_builder import build_draft_proposer

        proposer = build_draft_proposer(config, loaded, runner, sampler, max_model_len)
        propose_seconds = proposer.seconds_per_draft_step
    step_seconds = None
    if cost is not None:
        def step_seconds(rows: int, context_len: int) -> float:
            return cost.predict([(1, context_len)] * rows, num_logits=rows).predicted_seconds
    chooser = KChooser(spec.num_speculative_tokens, spec.speculative_adaptive, step_seconds, propose_seconds)
    return SpecDecoder(proposer, chooser, sampler, max_model_len)
