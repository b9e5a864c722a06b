"""The tensor-parallel transform, applied to a built model before the other build-time transforms
(gpt-fast's style; Megatron's layout, as vLLM uses it).

Shape legend: T tokens, Dm model width, H/Hkv query/KV heads, D head dim, I MLP width, V vocabulary,
Tp shards; a shard holds H/Tp query heads, max(1, Hkv/Tp) KV heads, I/Tp MLP columns, ceil(V/Tp)
vocabulary rows.

- column parallel: qkv_proj (each of q | k | v cut by heads, `qkv_sizes` gives the split) and
  gate_up_proj (gate | up each cut by columns) become smaller nn.Linear modules; their output stays
  sharded, no communication.
- row parallel: o_proj and down_proj keep their input columns of this shard; the partial sums are
  all-reduced by a forward hook on their parent (the attention block, the MLP), whose output is the
  projection's output. One all-reduce each, two per layer.
- attention sinks (gpt-oss's logit per query head) go with their heads.
- latent attention (DeepSeek's MLA): the query's and kv_b_proj's rows by heads, o_proj's columns; the latent
  (kv_a_proj_with_mqa, its norm) and its cache are every shard's whole (one latent row serves every head).
- KV heads: sharded with the query heads they serve; where Hkv < Tp each shard holds the one KV head
  of its query heads (replicated, as vLLM does).
- vocabulary parallel: the embedding looks up only its rows (zero elsewhere) and all-reduces; the
  head computes its ceil(V/Tp) logits and the executor gathers them (tied: the head shares the
  embedding shard's weight).
A mixture of experts' router is not a projection (replicated); its shared expert is an MLP like the dense
ones (sharded); its routed experts are split by parallel/expert_parallel.py, after this, under expert
parallelism, and otherwise sharded inside each expert (vLLM's default for a MoE at TP): every expert keeps I/Tp
of its gate and up rows and of its down columns, so a rank computes a partial sum of every routed expert, and
the sparse block's output (routed experts plus the shared expert) is all-reduced once.
The swapped modules are plain nn.Linear, so quantisation and the CPU linears still apply to each
shard (they walk `model.projections()` after this).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from servescope.errors import EngineConfigError
from servescope.model.linears.packed import QuantEmbedding, QuantLinear
from servescope.model.mla import LatentAttention
from servescope.model.moe import ClampedExperts, Experts, moe_blocks
from servescope.parallel.groups import DistContext
from servescope.parallel.layout import local_kv_heads
from servescope.parallel.packed_shards import packed_cols, packed_rows


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + ceil(V/Tp)) of the embedding (past V: zero padding); ids outside give 0,
    the all-reduce over the shards sums exactly one non-zero row per token."""

    def __init__(self, weight: torch.Tensor, start: int, num_real: int, ctx: DistContext):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.num_real, self._ctx = start, num_real, ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_real)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, Dm]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, self._ctx)


def all_reduce(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    ctx.comm.timed(dist.all_reduce, t, group=ctx.tp_group)
    return t


def _rows(linear: nn.Module, spans: list) -> nn.Module:
    """A Linear of the output rows in `spans` [(start, stop)...] concatenated (column parallel)."""
    if type(linear) is QuantLinear:
        return packed_rows(linear, spans)
    w = torch.cat([linear.weight.detach()[a:b] for a, b in spans])
    out = nn.Linear(linear.in_features, w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w.clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(torch.cat([linear.bias.detach()[a:b] for a, b in spans]).clone(), requires_grad=False)
    return out


def _cols(linear: nn.Module, start: int, stop: int, keep_bias: bool, name: str = "") -> nn.Module:
    """A Linear of the input columns [start, stop) (row parallel); the bias on one shard only."""
    if type(linear) is QuantLinear:
        return packed_cols(linear, start, stop, keep_bias, name)
    w = linear.weight.detach()[:, start:stop]
    bias = linear.bias is not None and keep_bias
    out = nn.Linear(stop - start, linear.out_features, bias=bias, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w.clone(), requires_grad=False)
    if bias:
        out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return out


def _kv_first_head(num_kv: int, tp: int, shard: int) -> int:
    """The first KV head shard `shard` holds: its own Hkv/Tp, or the one its query heads read."""
    return shard * (num_kv // tp) if num_kv >= tp else shard // (tp // num_kv)


def apply_tensor_parallel(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Shard `model` in place for shard ctx.shard of ctx.layout.tp (layout already checked)."""
    cfg, tp, shard = model.config, ctx.layout.tp, ctx.shard
    d = cfg.head_dim
    hq, hkv = cfg.num_attention_heads // tp, local_kv_heads(cfg, tp)
    kv0 = _kv_first_head(cfg.num_key_value_heads, tp, shard)
    blocks = [b for _, b in moe_blocks(model)] if ctx.layout.ep == 1 else []  # (experts sharded here)
    hooked = {id(s) for b in blocks for s in (getattr(b, "shared_expert", None), getattr(b, "shared_experts", None))
              if s is not None}  # no hook of their own: the block's all-reduces routed + shared at once
    for parent, name, mod in model.projections():
        if mod is None or name == "lm_head":
            continue
        if type(mod) not in (nn.Linear, QuantLinear):
            raise EngineConfigError(f"tensor parallelism shards nn.Linear modules and packed GGUF ones; {name} is "
                                    f"{type(mod).__name__}")
        if isinstance(parent, LatentAttention):
            if name in ("q_proj", "q_b_proj"):  # the last projection of the query: its rows by heads
                _shard_latent(parent, name, mod, hq, shard)
                continue
            if name in ("q_a_proj", "kv_a_proj_with_mqa"):  # the query's LoRA-down and the latent: every head's
                continue
        if name == "qkv_proj":
            q, k, _ = parent.qkv_sizes
            spans = [(shard * hq * d, (shard + 1) * hq * d), (q + kv0 * d, q + (kv0 + hkv) * d),
                     (q + k + kv0 * d, q + k + (kv0 + hkv) * d)]
            setattr(parent, name, _rows(mod, spans))
            parent.num_heads, parent.num_kv_heads, parent.qkv_sizes = hq, hkv, (hq * d, hkv * d, hkv * d)
            if getattr(parent, "sinks", None) is not None:  # gpt-oss: one logit per query head, with its head
                parent.sinks = nn.Parameter(parent.sinks.detach()[shard * hq:(shard + 1) * hq].clone(),
                                            requires_grad=False)
        elif name == "gate_up_proj":  # (a dense MLP's width, or a mixture's shared expert's)
            i = mod.out_features // 2
            n = i // tp
            setattr(parent, name, _rows(mod, [(shard * n, (shard + 1) * n), (i + shard * n, i + (shard + 1) * n)]))
        elif name in ("o_proj", "down_proj"):
            width = mod.in_features // tp
            setattr(parent, name, _cols(mod, shard * width, (shard + 1) * width, shard == 0, name))
            if id(parent) not in hooked:  # the parent's output is this projection's partial sum
                parent.register_forward_hook(lambda _m, _inp, out: all_reduce(out, ctx))
                hooked.add(id(parent))
        else:
            raise EngineConfigError(f"tensor parallelism does not know how to shard projection {name!r}")
    for block in blocks:
        _shard_experts(block.experts, tp, shard)
        block.register_forward_hook(lambda _m, _inp, out: all_reduce(out, ctx))  # routed + shared partial sums
    _shard_vocab(model, ctx)
    return model


def _shard_latent(attn: LatentAttention, name: str, mod: nn.Linear, hq: int, shard: int) -> None:
    """Latent attention's heads [s hq, (s + 1) hq): the query's rows (nope | rope per head) and kv_b_proj's
    (k_nope | v per head: W_UK and W_UV); the latent and its cache stay whole on every shard (they serve all
    heads, as in vLLM's MLA under TP), o_proj keeps this shard's heads' v columns (row parallel)."""
    qk, kv = attn.nope + attn.rope, attn.nope + attn.v_dim
    setattr(attn, name, _rows(mod, [(shard * hq * qk, (shard + 1) * hq * qk)]))
    attn.kv_b_proj = _rows(attn.kv_b_proj, [(shard * hq * kv, (shard + 1) * hq * kv)])
    attn.num_heads = hq


def _shard_experts(ex: nn.Module, tp: int, shard: int) -> None:
    """Every expert's gate and up rows [s n, (s + 1) n) and down columns (n = I/Tp), in place; gpt-oss's biases
    with them (the down bias on shard 0 only, as a row-parallel bias)."""
    if type(ex) not in (Experts, ClampedExperts):
        raise EngineConfigError(f"tensor parallelism shards float experts, not {type(ex).__name__} (packed experts "
                                "run under expert parallelism: --enable-expert-parallel)")
    i = ex.down_proj.shape[2]
    n = i // tp
    rows = torch.cat([torch.arange(shard * n, (shard + 1) * n), torch.arange(i + shard * n, i + (shard + 1) * n)])
    rows = rows.to(ex.gate_up_proj.device)
    ex.gate_up_proj = nn.Parameter(ex.gate_up_proj.detach()[:, rows].contiguous(), requires_grad=False)
    down = ex.down_proj.detach()[:, :, shard * n:(shard + 1) * n]
    ex.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
    if isinstance(ex, ClampedExperts):
        ex.gate_up_proj_bias = nn.Parameter(ex.gate_up_proj_bias.detach()[:, rows].contiguous(), requires_grad=False)
        if shard:
            ex.down_proj_bias = nn.Parameter(torch.zeros_like(ex.down_proj_bias), requires_grad=False)


def vocab_shard(vocab_size: int, tp: int, shard: int) -> tuple:
    """(first row, rows held incl. padding, real rows) of the vocabulary on `shard`."""
    per = -(-vocab_size // tp)
    start = shard * per
    return start, per, max(0, min(vocab_size, start + per) - start)


def _padded(weight: torch.Tensor, start: int, per: int, real: int) -> torch.Tensor:
    """Rows [start, start + real) of a table (float, or a packed one's blocks or scales), zero rows to `per`
    (zero scales: zero weights)."""
    out = torch.zeros(per, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
    out[:real] = weight.detach()[start:start + real]
    return out


def _shard_vocab(model: nn.Module, ctx: DistContext) -> None:
    """Embedding (on the first stage) and head (on the last) to their vocabulary shards, float or packed (a
    GGUF's token_embd / output blocks, sliced as they are); a tied pair shares one slice as in one process."""
    emb, head = model.model.embed_tokens, model.lm_head
    rows = vocab_shard(model.config.vocab_size, ctx.layout.tp, ctx.shard)
    start, per, real = rows
    tied = head is not None and _table(head) is _table(emb)
    if isinstance(emb, QuantEmbedding):
        model.model.embed_tokens = VocabParallelQuantEmbedding(_padded(emb.qweight, *rows), _padded(emb.scales, *rows),
                                                               emb.embedding_dim, emb.dtype, start, real, ctx)
    elif emb.weight.shape[0]:  # a stage that does not embed holds a zero-row embedding
        model.model.embed_tokens = VocabParallelEmbedding(_padded(emb.weight, *rows), start, real, ctx)
    if head is None:
        return
    new = model.model.embed_tokens
    if type(head) is QuantLinear:
        q, sc = (new.qweight, new.scales) if tied else (_padded(head.qweight, *rows), _padded(head.scales, *rows))
        model.lm_head = QuantLinear(q, sc, head.in_features, None, float_output=head.float_output)
        return
    model.lm_head = nn.Linear(head.in_features, per, bias=False, device=head.weight.device, dtype=head.weight.dtype)
    model.lm_head.weight = (new.weight if tied else nn.Parameter(_padded(head.weight, *rows), requires_grad=False))


def _table(m: nn.Module) -> torch.Tensor:
    """The tensor an embedding or a head reads its rows from (a packed one's blocks)."""
    return m.qweight if isinstance(m, (QuantEmbedding, QuantLinear)) else m.weight


class VocabParallelQuantEmbedding(QuantEmbedding):
    """VocabParallelEmbedding over a packed table's rows [start, start + ceil(V/Tp)): the rows looked up
    dequantised, ids outside give 0, the all-reduce sums exactly one non-zero row per token."""

    def __init__(self, packed, scales, dim: int, dtype: torch.dtype, start: int, num_real: int, ctx: DistContext):
        super().__init__(packed, scales, dim, dtype)
        self.start, self.num_real, self._ctx = start, num_real, ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = super().forward(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, self._ctx)
