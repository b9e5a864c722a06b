"""Pipeline stages: each rank keeps its stage's layers, and the stage's forward passes the hidden
state and the residual stream on to the next stage point-to-point.

Shape legend: T tokens in the step, Dm model width.

Stage 0 embeds; the last stage applies the final norm and holds the head (with tied embeddings it
keeps the embedding's weight as its head). A stage that does not embed holds a zero-row embedding
(the transforms read its dtype), one without the head `lm_head = None` (the transforms skip it).
A stage runs the model's own steps (`embed` on stage 0, the executor's layer path over the layers
it holds, `final_norm` on the last): one stage is a step of a model that is not cut.

A step cut into micro-batches (parallel/microbatch.py) overlaps the stages: each stage runs the
micro-batches in order and hands each one on with an asynchronous send as soon as it is done, and a
stage that receives posts all its receives at the start of the step, so stage s + 1 computes
micro-batch i while stage s computes i + 1 (analysis/pipeline_schedule.py has the schedule). With one
micro-batch the stages run one after the other: P > 1 then buys memory (each rank holds L/P layers and
their KV), not speed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from servescope.parallel.groups import DistContext
from servescope.parallel.microbatch import MicroBatch


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


def _neighbour(ctx: DistContext, step: int) -> int:
    """The same shard of the next (step 1) or the previous (step -1) stage."""
    return ctx.layout.rank_of(ctx.stage + step, ctx.shard)


def run_stage(model: nn.Module, pieces: list, layers, ctx: DistContext, dtype: torch.dtype) -> tuple:
    """This stage's part of a step, micro-batch by micro-batch -> (h, residual) [T, Dm] each of the
    whole step on the last stage, (None, None) elsewhere. layers(mb, h, residual) -> (h, residual) runs
    the stage's layers on one micro-batch. Hand-overs are asynchronous (tag: the micro-batch's index);
    the time spent waiting on them is this rank's communication time."""
    width, dev = model.config.hidden_size, model.model.norm.weight.device
    recvs = []
    if not ctx.is_first_stage:  # all posted now: micro-batch i + 1 arrives while i computes
        for i, mb in enumerate(pieces):
            buf = torch.empty(2, mb.hi - mb.lo, width, dtype=dtype, device=dev)  # (h, residual) [2, t, Dm]
            recvs.append((buf, dist.irecv(buf, _neighbour(ctx, -1), tag=i)))
    sends, outs = [], []
    for i, mb in enumerate(pieces):
        h, residual = _stage_input(model, mb, recvs[i] if recvs else None, ctx)
        h, residual = layers(mb, h, residual)
        if ctx.is_last_stage:
            outs.append((h, residual))
        else:
            out = torch.stack([h, residual])  # [2, t, Dm], kept alive until its send completes
            sends.append((out, dist.isend(out, _neighbour(ctx, 1), tag=i)))
    for out, work in sends:
        ctx.comm.wait(work, out)
    if not ctx.is_last_stage:
        return None, None
    if len(outs) == 1:
        return outs[0]
    return torch.cat([h for h, _ in outs]), torch.cat([r for _, r in outs])  # [T, Dm] each


def _stage_input(model: nn.Module, mb: MicroBatch, recv, ctx: DistContext) -> tuple:
    """(h, residual) a micro-batch enters this stage with: embedded on stage 0, received elsewhere."""
    if recv is None:
        return model.embed(mb.input_ids), None  # [t] -> [t, Dm]
    buf, work = recv
    ctx.comm.wait(work, buf)
    return buf[0], buf[1]
