"""Pipeline stages: each rank keeps its stage's layers, and the stage's forward passes the hidden
state and the residual stream on to the next stage point-to-point.

Shape legend: T tokens in the step, Dm model width.

Stage 0 embeds; the last stage applies the final norm and holds the head (with tied embeddings it
keeps the embedding's weight as its head). A stage that does not embed holds a zero-row embedding
(the transforms read its dtype), one without the head `lm_head = None` (the transforms skip it).
The model's own forward is the one-stage case; the layer loop here is the same loop over fewer layers.

Stages run one after the other within a step (no micro-batch overlap yet): the step's latency is the
sum of the stages', so P > 1 buys memory (each rank holds L/P layers and their KV), not speed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from servescope.kernels import fused_ops
from servescope.parallel.groups import DistContext


def keep_stage(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Drop in place what stage ctx.stage does not run."""
    if ctx.layout.pp == 1:
        return model
    backbone = model.model
    keep = ctx.layout.stage_layers(ctx.stage)
    backbone.layers = nn.ModuleList(backbone.layers[i] for i in keep)
    if not ctx.is_last_stage:
        model.lm_head = None
    if not ctx.is_first_stage:
        w = backbone.embed_tokens.weight
        # the head (tied) keeps its reference to the full embedding weight; the lookup goes
        backbone.embed_tokens = nn.Embedding(0, w.shape[1], device=w.device, dtype=w.dtype)
    return model


def run_layers(model: nn.Module, h: torch.Tensor, residual, positions: torch.Tensor, kv_caches: list,
               meta, backend) -> tuple:
    """This stage's layers over (h, residual) -> (h, residual) [T, Dm] each (residual None: stage 0)."""
    cos_sin = model.rotary.table(positions)
    for layer, kv in zip(model.model.layers, kv_caches):
        h, residual = layer(cos_sin, h, residual, kv, meta, backend)
    return h, residual


def final_norm(model: nn.Module, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    norm = model.model.norm
    return fused_ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]


def send_hidden(h: torch.Tensor, residual: torch.Tensor, ctx: DistContext) -> None:
    """(h, residual) [T, Dm] to the same shard of the next stage."""
    dst = ctx.layout.rank_of(ctx.stage + 1, ctx.shard)
    ctx.comm.timed(dist.send, torch.stack([h, residual]).contiguous(), dst)


def recv_hidden(num_tokens: int, width: int, dtype: torch.dtype, device: torch.device, ctx: DistContext) -> tuple:
    """(h, residual) [T, Dm] each from the same shard of the previous stage."""
    buf = torch.empty(2, num_tokens, width, dtype=dtype, device=device)
    ctx.comm.timed(dist.recv, buf, ctx.layout.rank_of(ctx.stage - 1, ctx.shard))
    return buf[0], buf[1]
