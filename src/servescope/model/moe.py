"""The MLP kind "moe": a router and routed experts (config/moe.py), executed grouped by expert.

Shape legend: T tokens, Dm model width, E experts, k experts per token, I one expert's MLP width.

Execution (vLLM's and SGLang's fused-MoE order, in plain PyTorch): the T*k (token, expert) pairs are
sorted by expert id, so that each active expert runs one gate|up and one down matmul over its contiguous
slice of tokens, and the weighted outputs are scatter-added back to their tokens. Only the experts some
token chose are touched: a batch-1 decode step reads k experts' weights per layer, not E. The experts'
weights are stacked per layer ([E, 2I, Dm] gate|up, [E, Dm, I] down: transformers 5's own layout), so one
expert is a contiguous slice and the checkpoint's per-expert tensors are stacked once at load
(`stack_expert_checkpoint`).

On the CPU the experts run that same order as one C++ op per layer (model/moe_fused.py): packed group-32
experts (GGUF Q4_0 / Q4_1 / Q8_0, --quantization int4 / int8-g32) on moe_packed up to the modules' packed-GEMV
row limit of tokens, float experts (gpt-oss's with their biases and clamped SwiGLU too) and per-channel int8
ones (--quantization int8) on moe_dense at any rows: the grouping, each expert's projections on the kernel its
module would choose for its rows, the activation and the weighted sum, the same roundings, so the same bits.
`grouped_experts` is the reference they are tested against and runs everything else (GPUs, long packed prefill
chunks, mixed formats).

Each block counts the tokens routed to each expert (`routed_tokens`, summed over the forwards since the
engine last took them: `take_routing`), which the step record reports (telemetry/moe.py).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from servescope.config import LayerSpec, ModelConfig
from servescope.kernels import fused_ops
from servescope.model import moe_fused
from servescope.model.layers import GatedMLP


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in float32,
    the top k kept, renormalised to sum to 1 where asked (transformers' order of operations)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_deepseek(logits: torch.Tensor, e, bias) -> tuple:
    """DeepSeek's routers (ExpertsSpec e, router "deepseek_v2" / "deepseek_v3"), transformers' order of float32
    operations: V2 softmax scores, V3 sigmoid scores plus the correction bias [E] (for the choice only); with
    groups, only the experts of the best topk_group groups are eligible (a group scored by its best expert, V3:
    by the sum of its best two); the top k scores, renormalised where norm_topk_prob (V3), times
    routed_scaling_factor. logits [T, E] float32 -> (weights [T, k] float32, ids [T, k])."""
    v3 = e.router == "deepseek_v3"
    scores = logits.sigmoid() if v3 else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores + bias if v3 else scores
    if e.n_group > 1:
        grouped = choice.view(-1, e.n_group, e.num_experts // e.n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if v3 else grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(e.topk_group, dim=-1)[1], 1)
        keep = keep.bool()[:, :, None].expand_as(grouped).reshape(choice.shape)
        choice = choice.masked_fill(~keep, float("-inf") if v3 else 0.0)
    ids = choice.topk(e.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if e.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * e.routed_scaling_factor, ids


def route_gpt_oss(logits: torch.Tensor, top_k: int) -> tuple:
    """gpt-oss's router: logits [T, E] (bias included) -> (weights [T, k], ids [T, k]): the top k logits,
    softmaxed over those k only, in the logits' dtype (transformers' GptOssTopKRouter)."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: nn.Module) -> tuple:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, and the tokens per expert [E].

    x [T, Dm], ids / weights [T, k], experts: Experts or PackedExperts (`run(e, xs, out)`, `num_experts`)
    -> ([T, Dm], counts [E] int64). One pass per active expert over its contiguous slice of the
    expert-sorted pairs; inactive experts are never visited (their weights are not read)."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept within each
    # the counts, and the slices' bounds from them, on the host (E small ints; one device-to-host copy): fewer
    # tensor ops per layer than indexing on the device
    counts = torch.bincount(flat, minlength=experts.num_experts).cpu()  # [E]
    per_expert = counts.tolist()
    ends = list(itertools.accumulate(per_expert))
    token_of = order // k  # [T*k] the token of each sorted pair
    xs = x.index_select(0, token_of)  # [T*k, Dm]
    ys = torch.empty_like(xs)
    for e in (e for e, n in enumerate(per_expert) if n):  # the active experts only
        rows = slice(ends[e] - per_expert[e], ends[e])
        experts.run(e, xs[rows], ys[rows])
    ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
    out = torch.zeros_like(x).index_add_(0, token_of, ys)  # [T, Dm]
    return out, counts


class Experts(nn.Module):
    """E gated MLPs of width I, stacked: gate_up_proj [E, 2I, Dm] (gate | up), down_proj [E, Dm, I]. On the CPU
    `grouped` runs the fused op (moe_fused.float_op) where it applies, `run` each expert on the kernel the op
    takes for its rows (moe_fused.expert_linear)."""

    fused = True  # whether `grouped` may run the fused op; False: grouped_experts always (the reference)

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width), requires_grad=False)

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """The routed experts' weighted sum and tokens per expert (grouped_experts, or the fused op)."""
        op = self._fused(x)
        if op is None:
            return grouped_experts(x, ids, weights, self)
        return tuple(op.run(x, ids, weights))

    def run(self, e: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        """Expert e over the rows xs [n, Dm], written into out [n, Dm]: hidden, then project_down."""
        self.project_down(e, self.hidden(e, xs), out)

    def hidden(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        """Expert e's silu(gate) * up of the rows xs [n, Dm]: [n, I], its down projection's input."""
        return fused_ops.silu_mul(moe_fused.expert_linear(xs, self.gate_up_proj[e]))

    def project_down(self, e: int, h: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(moe_fused.expert_linear(h, self.down_proj[e]))

    def _fused(self, x: torch.Tensor):
        """The fused op for rows in the weights' dtype (the CPU's MoeDense; a GPU's Triton GEMMs), else None."""
        if x.dtype != self.gate_up_proj.dtype or not self.fused:
            return None
        return moe_fused.triton_op(self) if x.is_cuda else self.fused_op() if x.device.type == "cpu" else None

    def fused_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of `dtype` the fused op may run: any (0: never)."""
        return moe_fused.ANY_ROWS if dtype == self.gate_up_proj.dtype and self.fused_op() is not None else 0

    def fused_op(self):
        """The fused op (MoeDense) over these experts, or None where it does not apply: built once per weights."""
        if not self.fused:
            return None
        key = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        return moe_fused.cached_op(self, key, lambda: moe_fused.float_op(self))

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a step reads per active expert)."""
        return (self.gate_up_proj[0].numel() + self.down_proj[0].numel()) * self.gate_up_proj.element_size()


class ClampedExperts(Experts):
    """gpt-oss's experts: Experts' stacked weights plus biases, gate_up_proj_bias [E, 2I] (gate | up) and
    down_proj_bias [E, Dm], and the clamped SwiGLU: gate clamped above at `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate). Each projection on Experts' kernel for its rows, its bias added in
    the activation dtype after it; on the CPU the fused op (moe_dense with the biases and act 1) runs them, on a
    GPU grouped_experts (the Triton grouped GEMMs have neither the biases nor the activation)."""

    act = 1  # the fused op's activation (csrc/moe_experts.h MOE_ACT_CLAMPED_SWIGLU)

    def __init__(self, num_experts: int, hidden: int, width: int, limit: float, alpha: float):
        super().__init__(num_experts, hidden, width)
        self.limit, self.alpha = limit, alpha
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def hidden(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        g = moe_fused.expert_linear(xs, self.gate_up_proj[e]) + self.gate_up_proj_bias[e]
        return fused_ops.clamped_swiglu(g, self.limit, self.alpha)

    def project_down(self, e: int, h: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(moe_fused.expert_linear(h, self.down_proj[e]) + self.down_proj_bias[e])

    def _fused(self, x: torch.Tensor):
        return super()._fused(x) if x.device.type == "cpu" else None

    def fused_op(self):
        if not self.fused:
            return None
        params = (self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias)
        return moe_fused.cached_op(self, tuple(p.data_ptr() for p in params), lambda: moe_fused.float_op(self))

    def expert_bytes(self) -> int:
        biases = self.gate_up_proj_bias[0].numel() + self.down_proj_bias[0].numel()
        return super().expert_bytes() + biases * self.gate_up_proj_bias.element_size()


class PackedExperts(nn.Module):
    """E gated MLPs as one linear module per expert and projection (QuantLinear over packed blocks, or
    Int8Linear): gate_up[e] Dm -> 2I (gate | up), down[e] I -> Dm. A step runs each active expert's two
    modules once over that expert's tokens, so a batch-1 decode reads k experts' packed blocks per layer
    through the packed GEMV (model/linears/packed.py chooses the kernel by rows, as for any projection);
    where a fused op applies (`_fused`: moe_packed, or moe_dense for Int8Linears), one C++ call runs all."""

    fused = True  # whether `grouped` may run the fused op; False: grouped_experts always (the reference)
    act, alpha, limit = 0, 0.0, 0.0  # the fused op's activation: silu(gate) * up (model/moe_clamped.py: gpt-oss's)

    def __init__(self, gate_up: list, down: list):
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate|up and {len(down)} down modules: one of each per expert")
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def run(self, e: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.down[e](fused_ops.silu_mul(self.gate_up[e](xs))))

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        op = self._fused(x)
        if op is None:
            return grouped_experts(x, ids, weights, self)
        return tuple(op.run(x, ids, weights))

    def _fused(self, x: torch.Tensor):
        """The fused op's handle where it runs this call, else None: float32 / bfloat16 rows on the CPU (int8
        experts: in their activation dtype), at most `fused_rows` of them (packed experts: so that every expert's
        rows would have taken quant_gemv in grouped_experts, the same kernels; a long prefill chunk takes
        grouped_experts' GEMMs)."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        return self.fused_op() if x.shape[0] <= self.fused_rows(x.dtype) else None

    def fused_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of `dtype` the fused op may run: the modules' quant_gemv row limit, any for
        int8 experts of that activation dtype (0: never)."""
        return moe_fused.packed_experts_rows(self, dtype) if self.fused else 0

    def fused_op(self):
        """The fused op (MoePacked, or MoeDense over Int8Linears) over these experts, or None where it does not
        apply (moe_fused): built once, and again after the weights move (the huge-page move replaces the
        buffers)."""
        return moe_fused.packed_experts_op(self) if self.fused else None

    def expert_bytes(self) -> int:
        return sum(_module_bytes(m) for m in (self.gate_up[0], self.down[0]))

    def linears(self) -> list:
        """Every expert's modules (the huge-page move and the weight count walk them)."""
        return [*self.gate_up, *self.down]

    def biases(self) -> tuple:
        """The fused op's per-expert float32 biases (gate|up [2I] list, down [H] list): none here."""
        return [], []


def _module_bytes(m: nn.Module) -> int:
    """Bytes of a linear module's weights: its own count where it has one (QuantLinear), else its buffers'."""
    if hasattr(m, "weight_bytes"):
        return m.weight_bytes()
    return sum(t.numel() * t.element_size() for t in m.buffers())


class SparseMoeBlock(nn.Module):
    """Kind "moe": router (`gate`, nn.Linear Dm -> E), routed experts, and Qwen2-MoE's shared expert (a
    GatedMLP every token runs, scaled by sigmoid(shared_expert_gate(x))) or DeepSeek's ungated `shared_experts`
    (its router: `route_deepseek`, in float32, with V3's `gate.e_score_correction_bias`)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        e = spec.mlp.experts
        self.spec, self.top_k, self.renormalise = e, e.top_k, e.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, e.num_experts, bias=e.biased)  # (gpt-oss's router: a bias)
        if e.router == "deepseek_v3":
            # a parameter, not a buffer: the loader fills parameters (and names any it misses)
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(e.num_experts), requires_grad=False)
        if e.biased:
            self.experts = ClampedExperts(e.num_experts, cfg.hidden_size, e.intermediate_size, e.swiglu_limit,
                                          e.swiglu_alpha)
        else:
            self.experts = Experts(e.num_experts, cfg.hidden_size, e.intermediate_size)
        if e.shared_intermediate_size and not e.shared_gated:
            self.shared_experts = GatedMLP(cfg, spec, e.shared_intermediate_size)
        elif e.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg, spec, e.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # since the last take_routing; on the host whatever device the build runs under (meta included)
        self.routed_tokens = torch.zeros(e.num_experts, dtype=torch.int64, device="cpu")
        # expert parallelism (parallel/expert_parallel.py): this rank's experts and the all-to-alls around them,
        # `run` in the experts' `grouped` place (the step's counts of every rank); None: every expert is here
        self.expert_parallel = None
        # the router's function, chosen once (config/moe.py's ROUTERS): x [T, Dm] -> (weights, ids [T, k])
        self._route = {"softmax_topk": self._route_softmax, "gpt_oss": self._route_gpt_oss,
                       "deepseek_v2": self._route_deepseek, "deepseek_v3": self._route_deepseek}[e.router]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(x)  # [T, k] each
        if self.expert_parallel is None:
            out, counts = self.experts.grouped(x, ids, weights)
        else:
            out, counts = self.expert_parallel.run(x, ids, weights, self.experts)
        self.routed_tokens += counts
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def _route_softmax(self, x: torch.Tensor) -> tuple:
        return route(self.gate(x), self.top_k, self.renormalise)

    def _route_gpt_oss(self, x: torch.Tensor) -> tuple:
        return route_gpt_oss(self.gate(x), self.top_k)

    def _route_deepseek(self, x: torch.Tensor) -> tuple:
        weight, bias = self._float32_router()
        return route_deepseek(F.linear(x.float(), weight), self.spec, bias)  # in float32

    def _float32_router(self) -> tuple:
        """DeepSeek routes in float32: the router's weight and correction bias as float32, converted once per
        change of the parameters (keyed on their storage and version counters: a load or a move converts
        again), not every step: in bfloat16 a V3-sized router is 256 x 7168 values per layer."""
        w, b = self.gate.weight, getattr(self.gate, "e_score_correction_bias", None)
        key = (w._version, w.data_ptr(), w.device, None if b is None else (b._version, b.data_ptr()))
        cached = self.__dict__.get("_router_f32")
        if cached is None or cached[0] != key:
            cached = (key, w.float(), None if b is None else b.float())
            self.__dict__["_router_f32"] = cached
        return cached[1], cached[2]

    def take_routing(self) -> torch.Tensor:
        """The tokens routed to each expert [E] since the last call, and start counting anew."""
        counts = self.routed_tokens.clone()
        self.routed_tokens.zero_()
        return counts

    def projections(self) -> list:
        """The swappable linears (the shared expert's; the router stays as it is, as vLLM keeps it)."""
        shared = getattr(self, "shared_expert", None) or getattr(self, "shared_experts", None)
        return shared.projections() if shared is not None else []


def moe_blocks(model: nn.Module) -> list:
    """(layer index, SparseMoeBlock) of every sparse layer the model holds."""
    layers = enumerate(model.model.layers)
    return [(i, layer.mlp) for i, layer in layers if isinstance(layer.mlp, SparseMoeBlock)]


def take_step_routing(model: nn.Module) -> tuple:
    """(tokens per expert of each sparse layer [[E ints]], bytes of one routed expert) since the last call:
    each block's counts taken and reset (one step's, the engine calls it once per step)."""
    blocks = moe_blocks(model)
    per_layer = [block.take_routing().tolist() for _, block in blocks]
    return per_layer, (blocks[0][1].experts.expert_bytes() if blocks else 0)
