"""`servescope quantize` for a mixture of experts (engine/calibrate.py's steps, for the routed experts).

What the file holds for a sparse layer (softmax top-k routers: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
  - each expert's gate, up and down packed in the mode's scheme, under the per-expert Hugging Face names a
    GGUF's experts get (loader/gguf_experts.expert_key: `mlp.experts.{e}.gate_proj`, Mixtral's
    `block_sparse_moe.experts.{e}.w1`) as `.qweight` / `.scales`, so the loader builds them into the same
    PackedExperts (and the fused MoE op) as a GGUF's or `--quantization` at load;
  - the router and Qwen2-MoE's shared-expert gate in float32 (vLLM and llama-quantize keep routers in float);
    the shared expert is a projection like any other (engine/calibrate.py).
gpt-oss (expert biases, clamped SwiGLU, sinks) and DeepSeek (latent attention, grouped sigmoid routers) are
still refused by check_saveable.

Calibration: an expert sees only the tokens routed to it, so its statistics come from a wrapper around each
float Experts' `run` (what grouped_experts calls per active expert with that expert's rows) during the
calibration forwards: per expert the summed squares of its gate|up inputs and of its down inputs. Experts are
rounded with those as importances (llama.cpp's imatrix, which also keeps only the diagonal for experts), for
--method imatrix and gptq alike: a full K x K Hessian per expert is E times a dense layer's memory (64 experts
of OLMoE: 16 GiB per layer in float64), and an expert no calibration token reached is plainly rounded. The
report's expert errors are the importance-weighted squared errors, sum((W - Q)^2 d) / sum(W^2 d), of the
method and of plain rounding (the diagonal's share of the output error)."""

from __future__ import annotations

import torch

from servescope.loader.gguf_experts import expert_key
from servescope.model.moe import Experts, moe_blocks
from servescope.quant.packed import dequantize, quantize
from servescope.quant.scheme import QuantScheme


def saveable_modules(model) -> set:
    """Names of the sparse layers' modules whose parameters the file holds: plain float experts and
    softmax top-k routers without a bias (and the shared-expert gate)."""
    names = {id(mod): prefix for prefix, mod in model.named_modules()}
    out = set()
    for _, block in moe_blocks(model):
        if type(block.experts) is Experts and block.spec.router == "softmax_topk" and block.gate.bias is None:
            out |= {names[id(block.experts)], names[id(block.gate)]}
            if hasattr(block, "shared_expert_gate"):
                out.add(names[id(block.shared_expert_gate)])
    return out


class ExpertStats:
    """Within `with ExpertStats(model) as stats:`, every forward's routed rows add to each expert's summed
    squares: stats.gate_up[layer] [E, Dm], stats.down[layer] [E, I] (float64), stats.tokens[layer] [E]."""

    def __init__(self, model):
        self.blocks = [(i, b.experts) for i, b in moe_blocks(model) if type(b.experts) is Experts]
        self.gate_up, self.down, self.tokens = {}, {}, {}

    def __enter__(self):
        for i, ex in self.blocks:
            e, i2, dm = ex.gate_up_proj.shape
            self.gate_up[i] = torch.zeros(e, dm, dtype=torch.float64)
            self.down[i] = torch.zeros(e, i2 // 2, dtype=torch.float64)
            self.tokens[i] = torch.zeros(e, dtype=torch.int64)
            ex.run = self._wrap(i, ex)  # (an instance attribute: grouped_experts calls experts.run)
            ex.fused = False  # grouped_experts, not the fused op (which never calls run)
        return self

    def _wrap(self, layer: int, ex: Experts):

        def counted(e: int, xs: torch.Tensor, out: torch.Tensor) -> None:
            x = xs.double()
            self.gate_up[layer][e] += (x * x).sum(0)
            h = ex.hidden(e, xs)  # Experts.run's two steps, its down projection's input counted between them
            self.down[layer][e] += (h.double() ** 2).sum(0)
            self.tokens[layer][e] += xs.shape[0]
            ex.project_down(e, h, out)
        return counted

    def __exit__(self, *exc):
        for _, ex in self.blocks:
            ex.__dict__.pop("run", None)
            ex.__dict__.pop("fused", None)
        return False

    def importance(self, layer: int, part: str, e: int):
        """Expert e's mean squared input [K] of `part` ("gate_up" | "down"), None where no token reached it."""
        n = int(self.tokens[layer][e]) if layer in self.tokens else 0
        return None if n == 0 else (getattr(self, part)[layer][e] / n).float()


def _weighted_error(w: torch.Tensor, wq: torch.Tensor, d: torch.Tensor) -> float:
    return float((((w - wq) ** 2) * d).sum() / ((w * w) * d).sum().clamp_min(1e-300))


def expert_tensors(model, scheme: QuantScheme, stats: ExpertStats | None, family: str) -> tuple:
    """({file name: tensor} of every sparse layer's experts, router and shared-expert gate, [(name, error of the
    method, of plain rounding)] of the experts a calibration token reached). stats None: plain rounding."""
    tensors, errors = {}, []
    for i, block in moe_blocks(model):
        ex = block.experts
        router = (f"model.layers.{i}.block_sparse_moe.gate.weight" if family == "mixtral"
                  else f"model.layers.{i}.mlp.gate.weight")
        tensors[router] = block.gate.weight.detach().float()
        if hasattr(block, "shared_expert_gate"):
            gate = block.shared_expert_gate.weight
            tensors[f"model.layers.{i}.mlp.shared_expert_gate.weight"] = gate.detach().float()
        width = ex.down_proj.shape[2]
        for e in range(ex.num_experts):
            for part, w in (("gate_up", ex.gate_up_proj[e]), ("down", ex.down_proj[e])):
                w = w.detach().float()
                d = stats.importance(i, part, e) if stats is not None else None
                q, sc = quantize(w, scheme, importance=d)
                if d is not None:
                    rq, rsc = quantize(w, scheme)
                    errors.append((f"model.layers.{i}.experts.{e}.{part}",
                                   _weighted_error(w, dequantize(q, sc, w.shape[1]), d),
                                   _weighted_error(w, dequantize(rq, rsc, w.shape[1]), d)))
                rows = (("gate", 0, width), ("up", width, width)) if part == "gate_up" else (("down", 0, w.shape[0]),)
                for name, r0, n in rows:
                    base = expert_key(family, str(i), name, e)[: -len(".weight")]
                    tensors[base + ".qweight"], tensors[base + ".scales"] = q[r0:r0 + n], sc[r0:r0 + n]
    return tensors, errors
