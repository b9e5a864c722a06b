"""A GGUF's mixture-of-experts layers: llama.cpp's names and metadata -> MoeConfig and per-expert HF tensors.

llama.cpp stores a sparse layer's experts stacked, one 3-D tensor per projection:
  blk.N.ffn_gate_inp.weight   router [E, Dm] (llama-quantize leaves it in float)
  blk.N.ffn_gate_exps.weight [E, I, Dm], blk.N.ffn_up_exps.weight [E, I, Dm], blk.N.ffn_down_exps.weight
  [E, Dm, I]
  blk.N.ffn_{gate,up,down}_shexp.weight, blk.N.ffn_gate_inp_shexp.weight [Dm]: Qwen2-MoE's shared expert and
  its sigmoid gate
and the experts' shape as `{arch}.expert_count`, `.expert_used_count`, `.expert_feed_forward_length` (the
dense `.feed_forward_length` where absent: Mixtral, OLMoE), `.expert_shared_feed_forward_length`. Whether the
kept top-k weights are renormalised is `.expert_weights_norm` where written, else what llama.cpp's graph for
the architecture does (`RENORMALISED`). A layer is sparse where its router is in the file (llama.cpp's
Qwen2/3-MoE graphs assume every layer is; a file converted from a checkpoint with dense layers says which).

The 3-D tensors are handed to the checkpoint as per-expert HF names (`mlp.experts.{e}.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.{e}.w1.weight`): views, no copy. Packed (Q4_0 / Q4_1 / Q8_0, the
K-quants repacked), each expert's rows are one slice of the tensor's blocks, and the build runs each expert
as its own packed linear (model/moe.py's PackedExperts, made by `packed_experts`).
"""

from __future__ import annotations

import logging
import re

import torch

from servescope.config.moe import ExpertsSpec, MoeConfig
from servescope.errors import ModelLoadError
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import PackedExperts, moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.quant.packed import dequantize

logger = logging.getLogger(__name__)

# GGUF general.architecture of a MoE family -> the family (Mixtral's GGUFs say "llama" with experts)
GGUF_MOE_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# llama.cpp's graph per family: whether the top-k weights are renormalised (build_moe_ffn's norm_w)
RENORMALISED = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
_STACKED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
# llama.cpp's per-layer MoE names (2-D and 1-D) -> HF module names under the layer
LAYER_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
               "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
               "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_PARTS = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def family_of(arch: str, fields: dict) -> str | None:
    """The MoE family of a GGUF (None: dense): by architecture, or "llama" with experts (Mixtral)."""
    if arch in GGUF_MOE_ARCHS:
        return GGUF_MOE_ARCHS[arch]
    return "mixtral" if arch == "llama" and int(fields.get("llama.expert_count") or 0) > 0 else None


def moe_from_gguf(meta, family: str, tensor_names: set, num_layers: int) -> MoeConfig:
    """The MoeConfig of a MoE GGUF (`meta`: loader/gguf.py's _Metadata). ModelLoadError on metadata that
    asks for routing the model does not implement (another gating function, scaled or grouped experts)."""
    gating = meta.arch_key("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{meta.path}: {meta.arch}.expert_gating_func {gating} (not softmax) is not "
                             "implemented")
    scale = meta.arch_key("expert_weights_scale")
    if scale not in (None, 1.0) or meta.arch_key("expert_group_count") not in (None, 0, 1):
        raise ModelLoadError(f"{meta.path}: scaled or grouped expert routing "
                             f"({meta.arch}.expert_weights_scale, .expert_group_count) is not implemented")
    count = int(meta.arch_key("expert_count", required=True))
    used = int(meta.arch_key("expert_used_count", required=True))
    width = meta.arch_key("expert_feed_forward_length") or meta.arch_key("feed_forward_length", required=True)
    norm = meta.arch_key("expert_weights_norm")
    shared = int(meta.arch_key("expert_shared_feed_forward_length") or 0)
    experts = ExpertsSpec(count, used, int(width), shared_intermediate_size=shared,
                          norm_topk_prob=RENORMALISED[family] if norm is None else bool(norm))
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers))
    if not any(sparse):
        raise ModelLoadError(f"{meta.path}: {meta.arch}.expert_count is {count} but no layer has a router "
                             "(blk.N.ffn_gate_inp.weight)")
    return MoeConfig(experts, sparse)


def layer_name(family: str, layer: str, gguf_part: str, kind: str) -> str | None:
    """The HF key of one of llama.cpp's per-layer MoE tensors (LAYER_NAMES), None for another name."""
    module = LAYER_NAMES.get(gguf_part)
    if module is None:
        return None
    if family == "mixtral" and module == "mlp.gate":
        module = "block_sparse_moe.gate"
    return f"model.layers.{layer}.{module}.{kind}"


def stacked_expert(name: str) -> tuple | None:
    """(layer, part "gate" | "up" | "down") of a stacked expert tensor's GGUF name, else None."""
    m = _STACKED.match(name)
    return (m.group(1), m.group(2)) if m else None


def expert_key(family: str, layer: str, part: str, expert: int) -> str:
    """The HF key of expert `expert`'s part in layer `layer` (Mixtral's block_sparse_moe w1 / w3 / w2)."""
    if family == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_PARTS[part][1]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{_PARTS[part][0]}.weight"


def split_experts(family: str, layer: str, part: str, tensor, count: int) -> dict:
    """A stacked tensor's per-expert pieces under their HF keys: `tensor` has the experts' rows one after
    another along its first dimension ([E, rows, K] floats, or packed blocks [E * rows, bytes] with their
    scales, given as a tuple of such tensors); each piece is a view."""
    if not isinstance(tensor, tuple):
        return {expert_key(family, layer, part, e): tensor[e] for e in range(count)}
    per = [p.reshape(count, -1, *p.shape[1:]) for p in tensor]
    return {expert_key(family, layer, part, e): tuple(p[e] for p in per) for e in range(count)}


def settle_experts(packed: dict, state_dict: dict, path: str, types: dict | None = None) -> None:
    """A sparse layer runs packed only when all its experts' parts are packed and gate and up share a block
    form (they are concatenated per expert); otherwise its packed parts are dequantised to float32 (a file
    whose down experts are in a type without a packed kernel, say), and one warning per model names those
    layers and their parts' block types (types: {(layer, "gate" | "up" | "down"): GGML type name}): such a
    layer's experts run through torch ops, and the C++ decode plan leaves the model to the modules."""
    layers: dict = {}
    for key in state_dict:
        m = _EXPERT_KEY.match(key)
        if m:
            layers.setdefault(m.group(1), []).append(key)
    floated: dict = {}  # the parts' types -> the layers of those types run float
    for layer, keys in layers.items():
        got = [packed.get(k) for k in keys]
        forms = {None if g is None else (g[0].dtype, g[1].dim())
                 for g, k in zip(got, keys) if not _is_down(k)}
        if all(g is None for g in got) or (None not in got and len(forms) == 1):
            continue
        for k, g in zip(keys, got):
            if g is not None:
                state_dict[k] = dequantize(g[0], g[1], g[2])
                del packed[k]
        named = ", ".join(f"{p} {types[(layer, p)]}" for p in _PARTS if (layer, p) in (types or {}))
        floated.setdefault(named or "block types mixed", []).append(layer)
    if floated:
        logger.warning("%s: experts run as float32, not packed (a layer's parts mix block types the packed "
                       "experts cannot): %s", path,
                       "; ".join(f"layer(s) {', '.join(ls)}: {named}" for named, ls in floated.items()))


_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)\.weight$")


def _is_down(key: str) -> bool:
    return key.endswith(("down_proj.weight", "w2.weight"))


def packed_experts(model: torch.nn.Module, packed: dict) -> None:
    """Swap each sparse layer's Experts whose every expert part is in `packed` ({HF key: (blocks, scales,
    K)}) for PackedExperts over those blocks (QuantLinear per expert and projection: gate | up concatenated
    per expert, as the float model fuses them); gpt-oss's (MXFP4, loader/hf_mxfp4.py) for PackedClampedExperts.
    Run on the model before its parameters are allocated, so the float experts never take memory
    (loader/build.py then drops these keys from the checkpoint).
    settle_experts has made each layer all packed or all float."""
    family = model.config.architecture
    for i, block in moe_blocks(model):
        n = block.experts.num_experts
        keys = {p: [expert_key(family, str(i), p, e) for e in range(n)] for p in _PARTS}
        if not all(k in packed for ks in keys.values() for k in ks):
            continue
        gate_up, down = [], []
        for e in range(n):
            g, u, d = (packed[keys[p][e]] for p in ("gate", "up", "down"))
            gate_up.append(QuantLinear(torch.cat([g[0], u[0]]), torch.cat([g[1], u[1]]), g[2]))
            down.append(QuantLinear(d[0], d[1], d[2]))
            for p in _PARTS:
                del packed[keys[p][e]]
        spec = block.spec
        if spec.biased:  # gpt-oss: its biases (loaded by name afterwards) and clamped SwiGLU
            block.experts = PackedClampedExperts(gate_up, down, spec.swiglu_limit, spec.swiglu_alpha, device="meta")
        else:
            block.experts = PackedExperts(gate_up, down)
