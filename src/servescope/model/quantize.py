"""Weight-only quantization applied after loading: `quantize_model(model, mode)`.

Modes (config/engine.py validates the spelling): `gguf` (nothing here: the loader kept a GGUF's own
blocks, loader/gguf_packed.py), `int8` (per output channel, symmetric: model/linears/int8.py's
Int8Linear) and the packed group-wise forms of quant/packed.py (model/linears/packed.py's QuantLinear),
`int4` (group 32, symmetric: GGUF Q4_0's scheme) or `int<4|8>-<g32|g64|g128|ch>[-sym|-asym]`, e.g.
int4-g128-asym, int8-g32 (Q8_0).

The output head is quantised too (the 4-bit modes' in int8 group 32: HEAD_SCHEME), and so is the
embedding table, as llama.cpp stores token_embd: its rows are kept packed and dequantised on lookup
(QuantEmbedding). A tied embedding and head share one packed copy, in the head's scheme (the file's one
tensor serves both, as a GGUF's token_embd does); an untied embedding takes the mode's own scheme (llama.cpp
quantises an untied token_embd to the file's main type). Applied by the engine's executor before the first
step.
"""

from __future__ import annotations

import logging

from torch import nn

from servescope.analysis.packed_weights import gguf_format_name
from servescope.errors import InvalidParameterError
from servescope.model.linears.huge_pages import move_to_huge_pages
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantEmbedding, QuantLinear, kept_panel
from servescope.model.moe import ClampedExperts, Experts, PackedExperts, moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.quant.packed import quantize
from servescope.quant.scheme import QuantScheme

logger = logging.getLogger(__name__)


def quantize_experts(model: nn.Module, scheme) -> None:
    """Every sparse layer's float experts (Experts) -> PackedExperts: one module per expert and projection,
    QuantLinear in `scheme`'s packed form, or Int8Linear for the per-channel "int8" mode. A layer's float
    experts are dropped once it is packed (a big MoE holds its float weights plus one layer's packed)."""
    act_dtype = model.model.norm.weight.dtype
    for _, block in moe_blocks(model):
        experts = block.experts
        if not isinstance(experts, Experts):
            continue  # (a GGUF's experts: packed by the loader)
        gate_up, down = [], []
        for e in range(experts.num_experts):
            for w, out in ((experts.gate_up_proj[e], gate_up), (experts.down_proj[e], down)):
                if scheme == "int8":
                    out.append(Int8Linear(w.data, None, act_dtype))
                else:
                    out.append(QuantLinear(*quantize(w.data, scheme), w.shape[1]))
        if isinstance(experts, ClampedExperts):  # gpt-oss: its biases and clamped SwiGLU kept
            packed = PackedClampedExperts(gate_up, down, experts.limit, experts.alpha)
            packed.gate_up_proj_bias, packed.down_proj_bias = experts.gate_up_proj_bias, experts.down_proj_bias
            block.experts = packed
        else:
            block.experts = PackedExperts(gate_up, down)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every projection of the decoder layers, and the output head, by Int8Linear. The embedding
    reads the head's int8 rows and per-row scales when they are tied, else becomes int8 per channel itself."""
    act_dtype = model.model.norm.weight.dtype  # (the embedding may be packed)
    quantize_experts(model, "int8")
    for parent, name, child in model.projections():
        if isinstance(child, nn.Linear):
            setattr(parent, name, Int8Linear(child.weight.data, child.bias, act_dtype))
    quantize_embedding(model, "int8")
    return model


def _float_embedding(model: nn.Module):
    """The float embedding table to quantise, or None: already packed (a GGUF's, a saved checkpoint's),
    a tensor-parallel vocabulary shard, or a pipeline stage that does not embed (zero rows)."""
    emb = model.model.embed_tokens
    return emb if type(emb) is nn.Embedding and emb.weight.shape[0] == model.config.vocab_size else None


def _tied(model: nn.Module, emb: nn.Embedding) -> bool:
    """Whether the (already quantised) head was made from this embedding's own table."""
    head = model.lm_head
    return (model.config.tie_word_embeddings and head is not None
            and getattr(head, "out_features", None) == emb.weight.shape[0])


def embedding_scheme(scheme: QuantScheme, tied: bool) -> QuantScheme:
    """The packed scheme of the embedding table under a mode's scheme: the head's when tied (one copy
    serves both), the mode's own when not (llama.cpp's token_embd)."""
    return projection_scheme("lm_head", scheme) if tied else scheme


def quantize_embedding(model: nn.Module, scheme) -> None:
    """The float embedding (if any: _float_embedding) becomes a QuantEmbedding: over the head's quantised
    buffers when tied (the head already quantised from this very table), else quantised on its own, in
    the mode's scheme (a QuantScheme, or "int8": int8 rows with a scale per row, as Int8Linear's)."""
    emb = _float_embedding(model)
    if emb is None:
        return
    dtype = model.model.norm.weight.dtype
    head = model.lm_head if _tied(model, emb) else None
    if isinstance(head, QuantLinear):
        packed, scales = head.qweight, head.scales
    elif isinstance(head, Int8Linear):
        packed, scales = head.weight_int8, head.scale
    elif scheme == "int8":
        rows = Int8Linear(emb.weight.data, None, dtype)
        packed, scales = rows.weight_int8, rows.scale
    else:
        packed, scales = quantize(emb.weight, embedding_scheme(scheme, model.config.tie_word_embeddings))
    model.model.embed_tokens = QuantEmbedding(packed, scales, emb.embedding_dim, dtype)


# The output head of the 4-bit modes: 8 bits in groups of 32 (llama.cpp keeps output.weight at 6-8 bits
# for the same reason: a 4-bit head alone took the mean KL against float32 from ~0.06 to ~0.46 here)
HEAD_SCHEME = QuantScheme(8, 32, False)


def projection_scheme(name: str, scheme: QuantScheme) -> QuantScheme:
    """The scheme of the projection `name` (model.projections()' attribute) under a mode's scheme."""
    return HEAD_SCHEME if name == "lm_head" and scheme.bits == 4 else scheme


def parse_mode(mode: str):
    """A mode string -> QuantScheme, "int8" for the per-channel Int8Linear, None for gguf. Raises
    InvalidParameterError naming the accepted forms."""
    if mode == "int8":
        return "int8"
    if mode == "gguf":
        return None
    parts = mode.split("-") if isinstance(mode, str) else []
    bits = {"int4": 4, "int8": 8}.get(parts[0] if parts else None)
    groups = {"g32": 32, "g64": 64, "g128": 128, "ch": None}
    rest = parts[1:]
    group = groups.get(rest.pop(0), 0) if rest and rest[0] in groups else 32 if bits == 4 else None
    asym = rest.pop(0) == "asym" if rest and rest[0] in ("sym", "asym") else False
    if bits is None or group == 0 or rest:
        raise InvalidParameterError("quantization", f"unknown quantization {mode!r}: use gguf, int8, int4, or "
                                    "int<4|8>-<g32|g64|g128|ch>[-sym|-asym] (e.g. int4-g128-asym)")
    return QuantScheme(bits, group, asym)


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every projection of the decoder layers and the output head by the mode's linear, and the
    embedding table by its packed form (quantize_embedding: tied, the head's own buffers).
    Modules already quantised (a GGUF's packed weights) keep their blocks. Then every packed weight,
    in decode order, moves into one huge-page mapping (move_to_huge_pages: decode reads them all)."""
    scheme = parse_mode(mode)
    if scheme == "int8":
        return quantize_int8(model)
    if scheme is not None:  # (gguf: the loader kept the file's blocks)
        quantize_experts(model, scheme)
        for parent, name, child in model.projections():
            if isinstance(child, nn.Linear):
                setattr(parent, name, QuantLinear.from_linear(child, projection_scheme(name, scheme),
                                                              float_output=name == "lm_head"))
        quantize_embedding(model, scheme)
    packed = [m for _, _, m in model.projections() if isinstance(m, QuantLinear)]
    packed += [m for _, block in moe_blocks(model) if isinstance(block.experts, PackedExperts)
               for m in block.experts.linears() if isinstance(m, QuantLinear)]
    packed += [m for m in model.modules() if isinstance(m, QuantEmbedding)]
    keep_panels(model)
    moved = move_to_huge_pages(packed)
    if moved:
        logger.info("packed weights: %.1f MiB moved to huge pages", moved / 2**20)
    return model


def keep_panels(model: nn.Module) -> int:
    """Every packed projection (the head too) and every packed expert in the CPU kernels' kept panels where they
    keep them (QuantLinear.keep_panels; a block's experts all or none: the fused MoE op reads one layout); a tied
    embedding reads the head's new buffers. Returns how many matrices were laid out anew."""
    rows = kept_panel()
    if not rows:
        return 0
    laid = {}  # a projection's old buffer -> the projection (a tied embedding shares the head's)
    for _, _, m in model.projections():
        old = m.qweight if isinstance(m, QuantLinear) else None
        if old is not None and m.keep_panels(rows):
            laid[old.data_ptr()] = m
    for _, block in moe_blocks(model):  # every expert of a block or none: the fused op takes one layout
        lins = block.experts.linears() if isinstance(block.experts, PackedExperts) else []
        if lins and all(isinstance(m, QuantLinear) and m.can_keep_panels(rows) for m in lins):
            for m in lins:
                laid[m.qweight.data_ptr()] = m
                m.keep_panels(rows)
    for emb in model.modules():
        if isinstance(emb, QuantEmbedding) and emb.qweight.data_ptr() in laid:
            emb.share_panels(laid[emb.qweight.data_ptr()])
    return len(laid)


def weight_format(model: nn.Module, mode: str | None) -> str | None:
    """The cost model's name for the decoder's packed weights (analysis/packed_weights.py): the mode
    for --quantization modes, a GGUF's q4_0 / q4_1 / q8_0 read off its first projection; None when
    the weights are not packed (float, per-channel int8) or a GGUF mixes in other types."""
    if mode in (None, "int8"):
        return None
    if mode != "gguf":
        return mode
    lin = next((c for _, _, c in model.projections() if isinstance(c, QuantLinear)), None)
    if lin is None:
        return None
    return gguf_format_name(lin.bits, lin.group, lin.asym)
