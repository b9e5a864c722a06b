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

A mixture of experts' routing (tokens per expert per sparse layer, and under expert parallelism the rows each
rank ran) is counted on the rank that runs the layer: after each step every later stage's shard 0 sends its
stage's to rank 0 (`send_stage_routing`), which records the whole step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from servescope.model.moe import moe_blocks
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
        emb = backbone.embed_tokens  # an nn.Embedding, or a GGUF's packed table (QuantEmbedding)
        w = emb.weight if isinstance(emb, nn.Embedding) else emb.scales
        dtype = w.dtype if isinstance(emb, nn.Embedding) else emb.dtype
        # the head (tied) keeps its reference to the full embedding table; the lookup goes
        backbone.embed_tokens = nn.Embedding(0, model.config.hidden_size, device=w.device, dtype=dtype)
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


ROUTING_TAG = 1 << 20  # (apart from the micro-batches' tags)


def send_stage_routing(model: nn.Module, ctx: DistContext) -> None:
    """A later stage's shard 0, after its part of a mixture of experts' step: its sparse layers' tokens per
    expert (taken and reset) and, under expert parallelism, the rows each of the stage's ranks ran, to rank 0,
    which records the whole step (`recv_stage_routing`). One int64 message [L_s * E + X]."""
    per_layer = [block.take_routing() for _, block in moe_blocks(model)]
    _, _, rows = ctx.experts.take()
    parts = per_layer + ([torch.tensor(rows, dtype=torch.int64)] if ctx.layout.ep > 1 else [])
    if parts:
        msg = torch.cat(parts).to(model.model.norm.weight.device)  # (NCCL sends device tensors only)
        ctx.comm.timed(dist.send, msg, 0, tag=ROUTING_TAG)


def recv_stage_routing(cfg, ctx: DistContext, device: torch.device) -> tuple:
    """Rank 0: ([[E ints]] per sparse layer of stages 1..P-1, [rows per rank of those stages] (empty without
    expert parallelism)), stage by stage."""
    layout, e = ctx.layout, cfg.moe.experts.num_experts
    per_layer, rows = [], []
    for stage in range(1, layout.pp):
        sparse = sum(cfg.moe.sparse_layers[i] for i in layout.stage_layers(stage))
        n = sparse * e + (layout.ep if layout.ep > 1 else 0)
        if not n:
            continue
        msg = torch.empty(n, dtype=torch.int64, device=device)
        ctx.comm.timed(dist.recv, msg, layout.rank_of(stage, 0), tag=ROUTING_TAG)
        msg = msg.cpu()
        per_layer += msg[:sparse * e].view(sparse, e).tolist()
        rows += msg[sparse * e:].tolist()
    return per_layer, rows
