"""Annotates each StepRecord with the cost model's FLOPs, bytes, bound and predicted time.

The engine calls analysis/ (pure functions); analysis never imports the engine.
"""

from __future__ import annotations

from typing import Optional

import torch

from servescope.analysis.collectives import LinkSpec, shard_config, step_comm_cost
from servescope.analysis.cost_model import step_cost
from servescope.analysis.pipeline_schedule import auto_micro_batches, pipelined_step
from servescope.analysis.hardware import HardwareSpec
from servescope.config import ModelConfig
from servescope.telemetry.step_record import StepRecord

_DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_KV_DT = {**_DT, torch.int8: "int8", getattr(torch, "float8_e4m3fn", None): "fp8_e4m3"}


class StepCostPredictor:
    def __init__(self, cfg: ModelConfig, hw: HardwareSpec, link: Optional[LinkSpec], dtype: torch.dtype,
                 kv_dtype: torch.dtype, quantization: Optional[str], tp: int = 1, pp: int = 1,
                 micro_batches: int = 0, weight_format: Optional[str] = None):
        """link: between the ranks of a parallel engine (None: no communication predicted).
        weight_format: the packed weights' format (model/quantize.weight_format), counted in their
        real bytes; None: float weights in the activation dtype, or per-channel int8."""
        # a tensor-parallel rank computes 1/T of each layer (shard_config); the link adds the collectives
        self.full_cfg, self.cfg, self.tp, self.pp = cfg, shard_config(cfg, tp), tp, pp
        self.micro_batches = micro_batches  # pipeline_micro_batches (0: auto), as the executor cuts
        self.hw = hw
        self.link = link if tp * pp > 1 else None
        self.act_bytes = dtype.itemsize
        self.act_dtype = _DT[dtype]
        self.weight_dtype = weight_format or ("int8" if quantization == "int8" else self.act_dtype)
        self.kv_dtype = _KV_DT[kv_dtype]

    def predict(self, seqs: list, num_logits: int):
        return step_cost(self.cfg, seqs, self.hw, self.weight_dtype, self.kv_dtype, self.act_dtype,
                         num_logits=num_logits)

    def annotate(self, rec: StepRecord, seqs: list, num_logits: int) -> None:
        """seqs: [(num_new_tokens, num_context_tokens_before)] of the step."""
        cost = self.predict(seqs, num_logits)
        rec.predicted_seconds = cost.predicted_seconds
        if self.pp > 1:  # the stages' schedule over the step's micro-batches (analysis/pipeline_schedule.py)
            m = auto_micro_batches(sum(n for n, _ in seqs if n > 1), self.pp, self.micro_batches)
            step = pipelined_step(self.full_cfg, seqs, self.hw, self.tp, self.pp, m, self.link,
                                  (self.weight_dtype, self.kv_dtype, self.act_dtype, self.act_bytes),
                                  num_logits=num_logits)
            rec.predicted_seconds = step.step_seconds
            rec.predicted_comm_seconds = step.comm_seconds if self.link is not None else None
        elif self.link is not None:
            comm = step_comm_cost(self.full_cfg, sum(n for n, _ in seqs), num_logits, self.tp, self.pp, self.link,
                                  self.act_bytes)
            rec.predicted_comm_seconds = comm.seconds
            rec.predicted_seconds += comm.seconds
        rec.flops = cost.flops
        rec.bytes = cost.bytes
        rec.flops_by_group = {o.name: o.flops for o in cost.ops}
        rec.bytes_by_group = {o.name: o.bytes for o in cost.ops}
        rec.bound = cost.bound
        rec.hardware = self.hw.name
