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
    draft_cost = None
    if spec.speculative_method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)  # host work of microseconds
    else:
        # a true cycle: the draft proposer is built from engine parts (a runner over the target's blocks)
        from servescope.engine.draft_builder import build_draft_proposer

        proposer, draft_cost = build_draft_proposer(config, loaded, runner, sampler, max_model_len)
    step_seconds = draft_step_seconds = None
    if cost is not None:
        step_seconds = _decode_rows_seconds(cost)
    if cost is not None and draft_cost is not None:
        draft_step_seconds = _decode_rows_seconds(draft_cost)
    chooser = KChooser(spec.num_speculative_tokens, spec.speculative_adaptive, step_seconds, draft_step_seconds)
    return SpecDecoder(proposer, chooser, sampler, max_model_len)


def _decode_rows_seconds(cost: StepCostPredictor):
    """(rows, context_len) -> the predicted step over that many one-token rows (logits at each)."""
    def seconds(rows: int, context_len: int) -> float:
        return cost.predict([(1, context_len)] * rows, num_logits=rows).predicted_seconds
    return seconds
