"""gpt-oss from GGUF files, as llama.cpp's converter writes them (conversion/gpt_oss.py's GptOssModel) and as
llama.cpp reads them (src/models/openai-moe.cpp: general.architecture "gpt-oss").

Tensors, per layer (llama.cpp name -> the Hugging Face checkpoint's):
  attn_norm -> input_layernorm, post_attention_norm -> post_attention_layernorm (the MLP's input norm)
  attn_q / attn_k / attn_v / attn_output weight and bias -> self_attn.{q,k,v,o}_proj (not permuted: NEOX rope)
  attn_sinks.weight [H] -> self_attn.sinks
  ffn_gate_inp weight [E, Dm] and bias [E] -> mlp.router
  ffn_gate_exps / ffn_up_exps [E, I, Dm], ffn_down_exps [E, Dm, I] and their biases [E, I] / [E, Dm]: the
  stacked experts, gate and up apart (the checkpoint interleaves them: mlp.experts.gate_up_proj [E, Dm, 2I] and
  its bias [E, 2I], gate in the even columns; down_proj [E, I, Dm] transposed)
The experts are MXFP4 in the files llama.cpp users have (GGML type 39: blocks of 32 = one E8M0 byte, then 16
bytes with element j in the low nibble of byte j and element j + 16 in its high one: quant/mxfp4.py's order,
so the nibbles are taken as they are and only the scale byte is moved out). MXFP4 experts always stay in their
blocks, as a Hugging Face MXFP4 directory's do: each expert's gate, up and down go to the build as packed
entries under per-expert keys (loader/gguf_experts.packed_experts makes the layer's PackedClampedExperts), the
stacked keys get zero-cost placeholders for the shape checks. Q4_0 / Q8_0 / K-quant experts stay packed with
quantization="gguf"; float experts (F32 / F16 / BF16), or a layer whose gate and up differ in block form, are
read into the checkpoint's float layout.

Metadata, with llama.cpp's defaults: `attention.sliding_window` (required, as llama.cpp reads it) over the
layers of `attention.sliding_window_pattern` (2 when absent: even layers windowed, transformers' layer_types);
yarn rope from `rope.scaling.*`; the experts' count, used count and width. llama.cpp's graph fixes the router
(top-k of the biased logits, softmaxed over those k: LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, 3) and the
clamped SwiGLU (alpha 1.702, limit 7): a file may say `swiglu_clamp_exp` for another limit (llama.cpp's key for
a clamp; its gpt-oss graph does not read it, so a converted release, which has none, runs at 7 either way).
Yarn's ramp is not rounded to whole dimensions (transformers' gpt-oss `truncate: false`; ggml rounds it), so the
file runs as the checkpoint it came from. Any other `gpt-oss.` key is refused naming it.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from servescope.config import RopeScaling
from servescope.config.moe import ExpertsSpec, MoeConfig
from servescope.errors import ModelLoadError
from servescope.loader import gguf_gemma, gguf_packed
from servescope.loader.gguf_experts import split_experts
from servescope.loader.gguf_file import f32_value

ARCH = "gpt-oss"
FAMILY = "gpt_oss"
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
          "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
OWN_KEYS = frozenset({
    "attention.value_length", "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
    "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_attn_factor", "expert_count", "expert_used_count", "expert_feed_forward_length",
    "expert_gating_func", "swiglu_clamp_exp"})
SOFTMAX_WEIGHT = 3  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, what its gpt-oss graph runs
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
MXFP4_BLOCK = 17  # bytes per block of 32: the E8M0 scale, then 16 bytes of nibbles


def hf_name(layer: str, part: str, kind: str) -> str | None:
    """The HF key of llama.cpp's gpt-oss layer tensor blk.{layer}.{part}.{kind}; None for the stacked experts
    (read_experts) and names gpt-oss does not have."""
    if part == "attn_sinks" and kind == "weight":
        return f"model.layers.{layer}.self_attn.sinks"
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}" if part in _LAYER else None


def is_expert_tensor(name: str) -> bool:
    return _EXPERTS.match(name) is not None


def yarn_scaling(meta) -> RopeScaling:
    """The yarn RopeScaling of a gpt-oss file (module doc: the ramp unrounded, as the checkpoint's)."""
    attn = meta.arch_key("rope.scaling.yarn_attn_factor")
    return RopeScaling(rope_type="yarn", factor=f32_value(meta.arch_key("rope.scaling.factor", 1.0)),
                       original_max_position_embeddings=int(meta.arch_key("rope.scaling.original_context_length",
                                                                          meta.arch_key("context_length", 4096))),
                       beta_fast=f32_value(meta.arch_key("rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=f32_value(meta.arch_key("rope.scaling.yarn_beta_slow", 1.0)),
                       attention_factor=f32_value(attn) if attn is not None else None, truncate=False)


def config_fields(meta, fields: dict, reader) -> dict:
    """The ModelConfig fields of a gpt-oss file's own maths; `fields`: what loader/gguf.py read already. meta:
    loader/gguf._Metadata. Raises ModelLoadError naming a key it does not read or a value it does not run."""
    path, prefix = meta.path, f"{ARCH}."
    unread = sorted(k for k in meta.reader.fields if k.startswith(prefix)
                    and k[len(prefix):] not in gguf_gemma.COMMON_KEYS | OWN_KEYS)
    if unread:
        raise ModelLoadError(f"{path}: GGUF metadata {unread[0]} is not implemented for {ARCH} (its maths would "
                             "be ignored)")
    names = {t.name: t for t in reader.tensors}
    for needed in ("blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.attn_q.bias"):
        if needed not in names:
            raise ModelLoadError(f"{path}: a gpt-oss file needs {needed} (llama.cpp requires it), the file lacks it")
    value_length = meta.arch_key("attention.value_length")
    if value_length is not None and int(value_length) != fields["head_dim"]:
        raise ModelLoadError(f"{path}: {ARCH}.attention.value_length {value_length} != key_length "
                             f"{fields['head_dim']} is not implemented")
    swa_base = meta.arch_key("rope.freq_base_swa")
    if swa_base is not None and f32_value(swa_base) != fields["rope_theta"]:
        raise ModelLoadError(f"{path}: {ARCH}.rope.freq_base_swa {swa_base} (a windowed layers' own rotary base) "
                             "is not implemented")
    if meta.arch_key("attention.sliding_window") is None:
        raise ModelLoadError(f"{path}: GGUF metadata is missing {ARCH}.attention.sliding_window")
    window, kinds = gguf_gemma.windows(meta, fields["num_hidden_layers"], fields["max_position_embeddings"])
    return dict(sliding_window=window, layer_types=kinds if len(set(kinds)) > 1 else (),
                attention_out_bias="blk.0.attn_output.bias" in names,
                moe=_moe(meta, fields, names))


def _moe(meta, fields: dict, names: dict) -> MoeConfig:
    gating = meta.arch_key("expert_gating_func")
    if gating not in (None, SOFTMAX_WEIGHT):
        raise ModelLoadError(f"{meta.path}: {ARCH}.expert_gating_func {gating} is not implemented (gpt-oss's "
                             f"router is llama.cpp's SOFTMAX_WEIGHT, {SOFTMAX_WEIGHT})")
    limit = meta.arch_key("swiglu_clamp_exp", SWIGLU_LIMIT)
    if not float(limit) > 0:
        raise ModelLoadError(f"{meta.path}: {ARCH}.swiglu_clamp_exp must be positive, got {limit}")
    width = meta.arch_key("expert_feed_forward_length") or fields["intermediate_size"]
    gate = names.get("blk.0.ffn_gate_exps.weight")
    e = ExpertsSpec(int(meta.arch_key("expert_count", required=True)),
                    int(meta.arch_key("expert_used_count", required=True)), int(width), router="gpt_oss",
                    swiglu_limit=f32_value(limit), swiglu_alpha=SWIGLU_ALPHA,
                    weight_format="mxfp4" if gate is not None and gate.tensor_type == T.MXFP4 else "")
    return MoeConfig(e, (True,) * fields["num_hidden_layers"])


def read_experts(tensors: list, config, keep_packed: bool, state_dict: dict, packed: dict, path: str) -> None:
    """The stacked expert tensors (TensorInfo) into the checkpoint's gpt-oss experts: packed entries per expert
    and placeholders where the layer runs packed, else float gate_up_proj / down_proj; the biases interleaved as
    the checkpoint's. ModelLoadError for a missing or misshapen tensor."""
    by_layer: dict = {}
    for t in tensors:
        layer, part, kind = _EXPERTS.match(t.name).groups()
        by_layer.setdefault(layer, {})[(part, kind)] = t
    e, d, width = config.moe.experts.num_experts, config.hidden_size, config.moe.experts.intermediate_size
    shapes = {"gate": (e, width, d), "up": (e, width, d), "down": (e, d, width)}
    for i in range(config.num_hidden_layers):
        got, p = by_layer.get(str(i), {}), f"model.layers.{i}.mlp.experts."
        for part, kind in ((x, k) for x in shapes for k in ("weight", "bias")):
            t = got.get((part, kind))
            want = shapes[part] if kind == "weight" else shapes[part][:2]
            if t is None:
                raise ModelLoadError(f"{path}: missing tensor blk.{i}.ffn_{part}_exps.{kind}")
            if tuple(int(s) for s in reversed(t.shape.tolist())) != want:
                raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(reversed(t.shape.tolist()))}, "
                                     f"expected {list(want)}")
        w = {part: got[(part, "weight")] for part in shapes}
        gate_b, up_b, down_b = (_floats(got[(x, "bias")], path) for x in shapes)
        state_dict[p + "gate_up_proj_bias"] = torch.stack([gate_b, up_b], dim=2).reshape(e, 2 * width)
        state_dict[p + "down_proj_bias"] = down_b
        if all(_packs(t, keep_packed) for t in w.values()) and w["gate"].tensor_type == w["up"].tensor_type:
            for part, t in w.items():
                k = shapes[part][2]
                pieces = split_experts(FAMILY, str(i), part, _blocks(t, e * shapes[part][1], k, path), e)
                packed.update({key: (q, s, k) for key, (q, s) in pieces.items()})
            state_dict[p + "gate_up_proj"] = gguf_packed.placeholder((e, d, 2 * width))
            state_dict[p + "down_proj"] = gguf_packed.placeholder((e, width, d))
            continue
        gate, up, down = (_floats(w[x], path).reshape(shapes[x]) for x in shapes)
        state_dict[p + "gate_up_proj"] = torch.stack([gate, up], dim=2).reshape(e, 2 * width, d).transpose(1, 2)
        state_dict[p + "down_proj"] = down.transpose(1, 2)


def _packs(t, keep_packed: bool) -> bool:
    return t.tensor_type == T.MXFP4 or (keep_packed and gguf_packed.is_native(t.tensor_type))


def _blocks(t, rows: int, k: int, path: str) -> tuple:
    """(packed, scales) of a stacked expert tensor's rows: MXFP4 as the engine's blocks [rows, k/2] and E8M0
    bytes [rows, k/32] (the nibbles are already in its order); the GGUF block types as loader/gguf_packed."""
    if t.tensor_type != T.MXFP4:
        try:
            return gguf_packed.split_blocks(t.data, t.tensor_type, rows, k)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from None
    raw = np.asarray(t.data, dtype=np.uint8)
    if k % 32 or raw.size != rows * (k // 32) * MXFP4_BLOCK:
        raise ModelLoadError(f"{path}: tensor {t.name}: MXFP4 rows of {k} weights need whole blocks of 32 "
                             f"({MXFP4_BLOCK} bytes each), the tensor holds {raw.size} bytes for {rows} rows")
    b = torch.from_numpy(raw.reshape(rows, k // 32, MXFP4_BLOCK).copy())  # (writable: the map is read-only)
    return b[..., 1:].reshape(rows, k // 2).contiguous(), b[..., 0].contiguous()


def _floats(t, path: str) -> torch.Tensor:
    try:
        w = dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot dequantise tensor {t.name} ({type(e).__name__}: {e})") from None
    return torch.from_numpy(np.array(w, dtype=np.float32))
