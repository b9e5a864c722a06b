"""Annotates each StepRecord with the cost model's FLOPs, bytes, bound and predicted time (the same
prediction the simulator advances its clock by: analysis/step_prediction.py).

The engine calls analysis/ (pure functions); analysis never imports the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from servescope.analysis.collectives import LinkSpec
from servescope.analysis.cost_model import StepCost
from servescope.analysis.moe import expected_distinct_experts
from servescope.analysis.step_prediction import StepPredictor
from servescope.analysis.hardware import HardwareSpec
from servescope.config import ModelConfig
from servescope.telemetry.step_record import StepRecord

_DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_KV_DT = {**_DT, torch.int8: "int8", getattr(torch, "float8_e4m3fn", None): "fp8_e4m3"}


class StepCostPredictor:
    """The engine's side of analysis/step_prediction.StepPredictor: torch dtypes in, StepRecords out."""

    def __init__(self, cfg: ModelConfig, hw: HardwareSpec, link: Optional[LinkSpec], dtype: torch.dtype,
                 kv_dtype: torch.dtype, quantization: Optional[str], tp: int = 1, pp: int = 1,
                 micro_batches: int = 0, weight_format: Optional[str] = None, ep: int = 1):
        """link: between the ranks of a parallel engine (None: no communication predicted).
        weight_format: the packed weights' format (model/quantize.weight_format), counted in their
        real bytes; None: float weights in the activation dtype, or per-channel int8."""
        act = _DT[dtype]
        weight = weight_format or ("int8" if quantization == "int8" else act)
        self.predictor = StepPredictor(cfg, hw, (weight, _KV_DT[kv_dtype], act, dtype.itemsize), tp, pp,
                                       micro_batches, link if max(tp, ep) * pp > 1 else None, ep)

    @property
    def hw(self) -> HardwareSpec:
        return self.predictor.hw

    def use_hardware(self, hw: HardwareSpec) -> None:
        """Predict from now on with `hw` (the same spec with the kernels timed at this model's shapes:
        measure/local_hardware.with_kernel_table). Every holder of this predictor sees the change."""
        self.predictor = dataclasses.replace(self.predictor, hw=hw)

    @property
    def act_dtype(self) -> str:
        """The activation dtype's name (the peak the dashboard's roofline is drawn at)."""
        return self.predictor.dtypes[2]

    def predict(self, seqs: list, num_logits: int) -> StepCost:
        """The roofline of one rank's shard for the step (no collectives, no pipeline schedule)."""
        return self.predictor.predict(seqs, num_logits).cost

    def annotate(self, rec: StepRecord, seqs: list, num_logits: int) -> None:
        """seqs: [(num_new_tokens, num_context_tokens_before)] of the step."""
        active = rec.moe_experts_active  # a MoE's measured routing prices its expert bytes
        step = self.predictor.predict(seqs, num_logits, sum(active) / len(active) if active else None)
        moe = self.predictor.cfg.moe
        if moe is not None:
            rec.moe_expected_experts = expected_distinct_experts(moe.experts.num_experts, moe.experts.top_k,
                                                                 sum(n for n, _ in seqs))
        cost = step.cost
        rec.predicted_seconds = step.seconds
        if step.comm_seconds is not None:
            rec.predicted_comm_seconds = step.comm_seconds
        rec.flops = cost.flops
        rec.bytes = cost.bytes
        rec.flops_by_group = {o.name: o.flops for o in cost.ops}
        rec.bytes_by_group = {o.name: o.bytes for o in cost.ops}
        rec.bound = cost.bound
        rec.hardware = self.hw.name
