"""Expert parallelism: a mixture of experts' routed experts split over the ranks of a stage, the tokens sent to
the experts they chose and the results sent back by all-to-all (gloo on the CPU, NCCL on GPUs). A transform
over the built model, like the tensor-parallel one, applied after it.

Shape legend: T tokens in the step, Dm model width, E experts, k experts per token, N expert-parallel ranks,
Tr = ceil(T / N) tokens per rank, R rows a rank's experts receive.

Who holds what: rank r keeps experts [r E/N, (r + 1) E/N) (contiguous ranges); the router, and the shared
expert and the dense layers where the attention is not sharded, are replicated; with tensor-parallel attention
(N = T, vLLM's enable_expert_parallel) the tensor-parallel transform has sharded the shared expert and the dense
MLPs as any MLP, with their all-reduce.

One sparse layer on every rank (`ExpertParallel.run`, in the block's grouped_experts place):
1. every rank holds all T tokens (attention replicated, or all-reduced after its shards) and has routed them
   all (the router is a small [T, E] matmul); rank r takes its slice, tokens [r Tr, min(T, (r + 1) Tr)).
2. the slice's T_r k (token, expert) pairs sorted by expert, so grouped by destination rank; the tokens per
   expert [E] of every rank all-gathered ([N, E]: what each rank is sent, and the step's whole routing).
3. dispatch: all_to_all_single of the pairs' rows [T_r k, Dm] with the per-rank counts as splits.
4. the rank's experts run over what they received (the experts' `grouped`: the fused op for packed group-32
   experts, else grouped_experts; the received rows grouped by expert).
5. combine: the results back by the reverse all_to_all_single; each pair's row times its routing weight,
   summed into its token (the single process's order of operations: expert-sorted pairs, index_add).
6. the slices all-gathered (padded to Tr rows) into [T, Dm]: every rank holds every token's output again.

Why all-to-alls where vLLM, at TP + EP without data parallelism, all-reduces: vLLM then runs each rank's
experts over every token routed to them and all-reduces [T, Dm] partial sums; it sends tokens to experts by
all-to-all when the ranks hold different tokens (data-parallel attention, or its sequence-parallel MoE, which
slices the TP ranks' tokens as step 1 does). The all-to-all is the pattern wide expert parallelism runs
(DeepEP, pplx) and the one whose bytes grow with k T / N rather than T; one path here serves EP with
replicated attention and TP + EP alike. Its cost against an all-reduce: analysis/collectives.py.

gloo in this torch has all_to_all_single with uneven splits (its list form `all_to_all` needs equal sizes),
so that is what is called.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from servescope.model.moe import ClampedExperts, Experts, PackedExperts, moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.parallel.groups import DistContext


def token_slice(num_tokens: int, ranks: int, rank: int) -> tuple:
    """[start, stop) of the tokens rank `rank` dispatches: ceil(T / N) each, the last ranks fewer (or none)."""
    per = -(-num_tokens // ranks)
    return min(num_tokens, rank * per), min(num_tokens, (rank + 1) * per)


def expert_range(num_experts: int, ranks: int, rank: int) -> range:
    per = num_experts // ranks
    return range(rank * per, (rank + 1) * per)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
    gather(out, inp, group=group)


class ExpertParallel:
    """One sparse layer's dispatch and combine on this rank (`run`: grouped_experts' signature)."""

    def __init__(self, ctx: DistContext, num_experts: int):
        self.ctx, self.num_experts = ctx, num_experts
        self.ranks, self.rank = ctx.layout.ep, ctx.shard
        self.local = expert_range(num_experts, self.ranks, self.rank)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: nn.Module) -> tuple:
        """x [T, Dm], ids / weights [T, k] (every token's routing) -> (the routed experts' output [T, Dm],
        the step's tokens per expert [E] over every rank); `experts` holds this rank's E/N experts."""
        t, k = ids.shape
        lo, hi = token_slice(t, self.ranks, self.rank)
        flat = ids[lo:hi].reshape(-1)  # [T_r k]
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by destination rank
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        every = torch.empty(self.ranks * self.num_experts, dtype=counts.dtype, device=counts.device)
        self._timed(_all_gather, every, counts, counts.numel() * counts.element_size())
        every = every.cpu().view(self.ranks, -1)  # [N, E]: one device-to-host copy per layer (splits are host ints)
        send_splits = every[self.rank].view(self.ranks, -1).sum(1).tolist()
        received = every[:, self.local.start:self.local.stop]  # [N, E/N]: what each rank sends here
        recv_splits = received.sum(1).tolist()
        rows = x[lo:hi].index_select(0, token_of)  # [T_r k, Dm]
        got = rows.new_empty(sum(recv_splits), x.shape[1])  # [R, Dm]
        self._all_to_all(got, rows, recv_splits, send_splits)
        local_ids = torch.arange(len(self.local), device=x.device).repeat(self.ranks)
        local_ids = local_ids.repeat_interleave(received.reshape(-1).to(x.device)).unsqueeze(1)  # [R, 1]
        ys, _ = experts.grouped(got, local_ids, torch.ones_like(local_ids, dtype=x.dtype))  # the fused op where it runs
        back = torch.empty_like(rows)
        self._all_to_all(back, ys, send_splits, recv_splits)
        back.mul_(weights[lo:hi].reshape(-1).index_select(0, order).unsqueeze(1))
        per = -(-t // self.ranks)
        mine = x.new_zeros(per, x.shape[1]).index_add_(0, token_of, back)  # [Tr, Dm], padded past hi - lo
        out = x.new_empty(per * self.ranks, x.shape[1])
        self._timed(_all_gather, out, mine, mine.numel() * mine.element_size())
        total = every.sum(0)  # [E]
        self.ctx.experts.add_rows(total.view(self.ranks, -1).sum(1).tolist())
        return out[:t], total

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list) -> None:
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ctx.tp_group)
        seconds = time.perf_counter() - t0
        sent = (inp.shape[0] - in_splits[self.rank]) * inp.shape[1] * inp.element_size()  # to the other ranks
        traffic, comm = self.ctx.experts, self.ctx.comm
        traffic.seconds, traffic.bytes = traffic.seconds + seconds, traffic.bytes + sent
        comm.seconds, comm.bytes = comm.seconds + seconds, comm.bytes + sent

    def _timed(self, fn, out: torch.Tensor, inp: torch.Tensor, num_bytes: int) -> None:
        t0 = time.perf_counter()
        fn(out, inp, self.ctx.tp_group)
        self.ctx.comm.seconds += time.perf_counter() - t0
        self.ctx.comm.bytes += num_bytes


def _local_experts(experts: nn.Module, keep: range) -> nn.Module:
    """The experts of `keep` only (ids from 0), the others' weights dropped."""
    if isinstance(experts, PackedClampedExperts):  # (gpt-oss's: its biases split with the experts)
        out = PackedClampedExperts([experts.gate_up[e] for e in keep], [experts.down[e] for e in keep],
                                   experts.limit, experts.alpha)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            setattr(out, name, nn.Parameter(getattr(experts, name).detach()[keep.start:keep.stop].clone(),
                                            requires_grad=False))
        return out
    if isinstance(experts, PackedExperts):
        return PackedExperts([experts.gate_up[e] for e in keep], [experts.down[e] for e in keep])
    if isinstance(experts, Experts):
        out = (ClampedExperts(len(keep), 1, 1, experts.limit, experts.alpha) if isinstance(experts, ClampedExperts)
               else Experts(len(keep), 1, 1))
        for name, p in experts.named_parameters(recurse=False):
            setattr(out, name, nn.Parameter(p.detach()[keep.start:keep.stop].clone(), requires_grad=False))
        return out
    raise TypeError(f"expert parallelism splits Experts or PackedExperts, not {type(experts).__name__}")


def apply_expert_parallel(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Keep this rank's experts in every sparse layer and route through the all-to-alls (layout checked)."""
    for _, block in moe_blocks(model):
        e = block.experts.num_experts
        block.experts = _local_experts(block.experts, expert_range(e, ctx.layout.ep, ctx.shard))
        block.expert_parallel = ExpertParallel(ctx, e)
    return model
