"""Load a GGUF file: config from its metadata, tensors dequantised to float32 under HF key names.

Dequantisation uses the `gguf` package (F32, F16, BF16, Q4_0, Q4_1, Q5_x, Q8_0 and the K-quants it
implements). llama.cpp's converter permutes the rows of Q and K for the "llama" architecture so
that its rotary kernel can rotate adjacent pairs; HF checkpoints rotate the two halves of each head
("rotate_half"). We undo that permutation here, exactly as transformers' GGUF loader does, so the
weights are bit-identical to what `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` gets.
Qwen2/Qwen3 GGUFs are not permuted (llama.cpp runs them with NEOX-style rope), nor are Gemma's, whose
names, folded norms and metadata loader/gguf_gemma.py reads (DeepSeek's: gguf_deepseek.py; gpt-oss's, with
its MXFP4 experts, which always stay packed: gguf_gpt_oss.py).

Q4_0, Q4_1 and Q8_0 weights of the projections, the head and the embedding stay in their blocks
with keep_packed (`--quantization gguf`; loader/gguf_packed.py); otherwise everything is float32.
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from servescope.config import ModelConfig, RopeScaling
from servescope.config.families import family as family_row
from servescope.config.families import family_of_gguf, gguf_architectures
from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.loader import gguf_deepseek, gguf_experts, gguf_gemma, gguf_gpt_oss, gguf_packed
from servescope.loader.hf_mxfp4 import drop_packed_placeholders
from servescope.loader.gguf_file import f32_value, read_gguf
from servescope.loader.checkpoint import LoadedSource, check_state_dict
from servescope.tokenizer.family_templates import family_template
from servescope.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SANDWICH_LAYER_NAMES = {**_LAYER_NAMES, **gguf_gemma.SANDWICH_NORMS}  # Gemma's four norms a layer
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """Map a GGUF tensor name of general.architecture `arch` to its HF checkpoint key; None for tensors we do
    not use (rope_freqs)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and arch == gguf_deepseek.ARCH:  # latent attention, DeepSeek's router and shared experts
        return gguf_deepseek.hf_name(*m.groups())
    if m and arch == gguf_gpt_oss.ARCH:  # sinks, the router's bias, the MLP's input norm
        return gguf_gpt_oss.hf_name(*m.groups())
    names = _SANDWICH_LAYER_NAMES if arch in gguf_gemma.FAMILIES else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows: per head, interleaved pairs -> two halves.

    w: [n_head * D, ...] (weight [n_head*D, hidden] or bias [n_head*D]).
    """
    d_half = w.shape[0] // n_head // 2
    # [n_head, D/2, 2, ...] -> [n_head, 2, D/2, ...]: row 2j (+1) of a head goes back to j (+ D/2)
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str, keep_packed: bool = False) -> LoadedSource:
    """Read a .gguf file into a LoadedSource. Raises ModelLoadError naming the file on any problem."""
    try:
        reader = read_gguf(path)
    except Exception as e:  # corrupt header, truncated metadata, random bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    meta = _Metadata(reader, path)
    try:
        config = _config_from_metadata(meta, reader, path)
    except (TypeError, ValueError, ArithmeticError) as e:  # a metadata value of the wrong type or range
        raise ModelLoadError(f"{path}: invalid GGUF metadata ({type(e).__name__}: {e})") from None
    state_dict, packed = _read_tensors(reader, config, meta.arch, path, keep_packed)
    state_dict = drop_packed_placeholders(check_state_dict(state_dict, config, path), packed)  # (gpt-oss's)

    eos_ids = list(config.eos_token_ids)
    chat_template = (meta.get("tokenizer.chat_template")
                     or family_template(family_row(config.architecture).chat_template))
    generation_config = {"eos_token_id": eos_ids}
    if config.bos_token_id is not None:
        generation_config["bos_token_id"] = config.bos_token_id
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        generation_config["pad_token_id"] = int(pad)
    return LoadedSource(
        config=config,
        state_dict=state_dict,
        tokenizer_source=TokenizerSource(
            path=os.path.dirname(os.path.abspath(path)),
            gguf_file=os.path.basename(path),
            chat_template=chat_template,
            eos_token_ids=tuple(eos_ids),
            model_type=config.architecture,
        ),
        path=path,
        format="gguf",
        chat_template=chat_template,
        generation_config=generation_config,
        packed=packed,
    )


class _Metadata:
    """Typed access to GGUF key/value metadata."""

    def __init__(self, reader, path: str):
        self.reader, self.path = reader, path
        self.raw_arch = self.get("general.architecture")
        if self.raw_arch is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
        self.arch = self.raw_arch

    def get(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def arch_key(self, suffix: str, default=None, required: bool = False):
        v = self.get(f"{self.arch}.{suffix}", default)
        if v is None and required:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing {self.arch}.{suffix}")
        if isinstance(v, list):  # per-layer values: we support uniform layers only
            if len(set(v)) != 1:
                raise ModelLoadError(f"{self.path}: {self.arch}.{suffix} varies per layer ({v[:4]}...), unsupported")
            v = v[0]
        return v


# {arch}.{suffix} GGUF metadata that changes the maths (llama.cpp's names) and is not implemented (Gemma's
# architectures and gpt-oss read them: loader/gguf_gemma.py, gguf_gpt_oss.py, which refuse any key they do not read)
GGUF_UNIMPLEMENTED = ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                      "attention.sliding_window_pattern")


def _config_from_metadata(meta: _Metadata, reader, path: str) -> ModelConfig:
    arch = meta.raw_arch
    fam = family_of_gguf(arch)
    if fam is None or fam.fused_checkpoint:  # a fused family's GGUF tensor names are not mapped yet
        supported = [a for a in gguf_architectures() if not family_of_gguf(a).fused_checkpoint]
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(supported)} (llama: Llama 2/3, SmolLM, Mistral)")
    # Mistral GGUFs say "llama" (detected from general.name below), Mixtral's "llama" with experts
    family = gguf_experts.family_of(arch, reader.fields) or fam.name
    name = meta.get("general.name") or os.path.basename(path)
    if family == "llama" and "mistral" in str(name).lower():
        family = "mistral"
    for suffix in GGUF_UNIMPLEMENTED:  # maths llama.cpp applies that the model does not: refused, not ignored
        if arch not in (*gguf_gemma.FAMILIES, gguf_gpt_oss.ARCH) and meta.arch_key(suffix) is not None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{suffix} asks for attention maths that is "
                                 "not implemented")
    tensor_names = {t.name for t in reader.tensors}
    hidden = _positive_int(meta, "embedding_length", meta.arch_key("embedding_length", required=True))
    heads = _positive_int(meta, "attention.head_count", meta.arch_key("attention.head_count", required=True))
    kv_heads = _positive_int(meta, "attention.head_count_kv", meta.arch_key("attention.head_count_kv", heads))
    head_dim = _positive_int(meta, "attention.key_length", meta.arch_key("attention.key_length", hidden // heads))
    rope_dim = meta.arch_key("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim and arch != gguf_deepseek.ARCH:
        raise ModelLoadError(f"{path}: partial rotary embedding (rope.dimension_count {rope_dim} != head_dim "
                             f"{head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.arch_key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, no token list)")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    layers = int(meta.arch_key("block_count", required=True))
    moe = (gguf_experts.moe_from_gguf(meta, family, tensor_names, layers)
           if family in gguf_experts.RENORMALISED else None)
    try:
        fields = dict(
            architecture=family,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(meta.arch_key("feed_forward_length", required=True)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(meta.arch_key("context_length", 4096)),
            rms_norm_eps=f32_value(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=f32_value(meta.arch_key("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta, reader, head_dim, path),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm=family == "qwen3" or "blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            name=str(name),
            moe=moe,
        )
        if arch in gguf_gemma.FAMILIES:  # windows, soft-caps, local rotary base, attention scale
            fields.update(gguf_gemma.config_fields(meta, fields))
        if arch == gguf_deepseek.ARCH:  # latent attention, DeepSeek's experts, yarn's softmax scale
            fields.update(gguf_deepseek.config_fields(meta, fields, tensor_names))
        if arch == gguf_gpt_oss.ARCH:  # windows, sinks, gpt-oss's experts
            fields.update(gguf_gpt_oss.config_fields(meta, fields, reader))
        return ModelConfig(**{**fields, **family_row(family).fixed})  # (OLMoE: its q/k norm over all heads)
    except InvalidParameterError as e:
        raise ModelLoadError(f"{path}: invalid model config in GGUF metadata: {e.message}") from None


def _positive_int(meta: _Metadata, suffix: str, value) -> int:
    """A size from the metadata as a positive int, else a ModelLoadError naming the key (a head count
    of 0 would divide by zero further on)."""
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ModelLoadError(f"{meta.path}: {meta.arch}.{suffix} is not an integer ({value!r})") from None
    if n <= 0:
        raise ModelLoadError(f"{meta.path}: {meta.arch}.{suffix} must be positive, got {n}")
    return n


def _rope_scaling(meta: _Metadata, reader, head_dim: int, path: str):
    rtype = meta.arch_key("rope.scaling.type")
    if rtype in (None, "none"):
        # Llama 3.1+ GGUFs carry llama3 scaling as a `rope_freqs` tensor of per-frequency divisors
        # instead of metadata. The divisor is `factor` for low frequencies; low/high_freq_factor and
        # the original context (1, 4, 8192) are the same in every Llama 3.1/3.2/3.3 release.
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":
                factor = float(np.max(np.asarray(t.data, dtype=np.float32)))
                if factor > 1.0:
                    logger.info("%s: rope_freqs tensor found: using llama3 rope scaling, factor %g", path, factor)
                    return RopeScaling(rope_type="llama3", factor=factor)
        return None
    if rtype == "yarn" and meta.raw_arch in (gguf_deepseek.ARCH, gguf_gpt_oss.ARCH):
        return (gguf_deepseek if meta.raw_arch == gguf_deepseek.ARCH else gguf_gpt_oss).yarn_scaling(meta)
    if rtype == "linear":
        return RopeScaling(rope_type="linear", factor=float(meta.arch_key("rope.scaling.factor", 1.0)))
    raise ModelLoadError(f"{path}: unsupported rope scaling type {rtype!r} (supported: none, linear, llama3)")


def _runs_packed(t, hf_name: str) -> bool:
    # (latent attention's kv_b_proj stays float: its weight is read as W_UK and W_UV, model/mla.py)
    return gguf_packed.is_native(t.tensor_type) and hf_name.endswith(("proj.weight", "proj_with_mqa.weight",
                                                                      "embed_tokens.weight", "lm_head.weight")) \
        and not hf_name.endswith("kv_b_proj.weight")


def _read_tensors(reader, config: ModelConfig, arch: str, path: str, keep_packed: bool) -> tuple:
    """(state dict, packed blocks {hf name: (packed, scales, K)}); packed tensors have a placeholder
    in the state dict."""
    file_size = os.path.getsize(path)
    norm_offset = family_row(config.architecture).norm_offset
    state_dict, packed, dequantised, repacked, experts, expert_types = {}, {}, {}, {}, [], {}
    for t in reader.tensors:
        if arch == gguf_gpt_oss.ARCH and gguf_gpt_oss.is_expert_tensor(t.name):  # read by layer, after the loop
            experts.append(t)
            continue
        hf_name = gguf_to_hf_name(t.name, arch) or _expert_layer_name(t.name, config)
        stacked = gguf_experts.stacked_expert(t.name) if config.moe else None
        if hf_name is None and stacked is None:
            logger.debug("%s: skipping tensor %s", path, t.name)
            continue
        if t.data_offset + t.n_bytes > file_size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated file: tensor {t.name} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes} "
                f"but the file has {file_size} bytes"
            )
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if stacked is not None:
            expert_types[stacked] = t.tensor_type.name  # (settle_experts names them if the layer runs float)
            _read_stacked_experts(t, shape, stacked, config, keep_packed, state_dict, packed, path)
            continue
        runs_packed = len(shape) == 2 and keep_packed and _runs_packed(t, hf_name)
        if runs_packed or (len(shape) == 2 and t.tensor_type in gguf_packed.NATIVE):
            try:
                qs, scales = gguf_packed.split_blocks(t.data, t.tensor_type, *shape)
            except ValueError as e:
                raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from None
            if runs_packed:
                if t.tensor_type in gguf_packed.REPACKED:
                    repacked[t.tensor_type.name] = repacked.get(t.tensor_type.name, 0) + 1
                qs, scales = _unpermute(qs, hf_name, arch, config), _unpermute(scales, hf_name, arch, config)
                packed[hf_name] = (qs, scales, shape[1])
                state_dict[hf_name] = gguf_packed.placeholder(shape)
            else:  # Q4_0 / Q4_1 / Q8_0 with torch (all threads; bit-identical to gguf-py's numpy, ~10x faster)
                w = gguf_packed.dequantize(qs, scales, shape[1])
                state_dict[hf_name] = _unpermute(w, hf_name, arch, config).contiguous()
            continue
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            dequantised[t.tensor_type.name] = dequantised.get(t.tensor_type.name, 0) + 1
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{path}: tensor {t.name} uses quantisation {t.tensor_type.name}, which the gguf package cannot "
                f"dequantise"
            ) from None
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot dequantise tensor {t.name} ({type(e).__name__}: {e})") from None
        if w.size != int(np.prod(shape)):
            raise ModelLoadError(f"{path}: tensor {t.name} has {w.size} values, its header says {list(shape)}")
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp's is 1-D
            shape = (1, shape[0])
        w = _unpermute(w.reshape(shape), hf_name, arch, config)
        if norm_offset and hf_name.endswith("norm.weight"):  # stored with Gemma's 1 added (loader/gguf_gemma.py)
            w = w - np.float32(norm_offset)
        if t.tensor_type == GGMLQuantizationType.F32 or not w.flags.writeable:
            w = w.copy()  # F32 "dequantisation" is a view of the memory-mapped file
        state_dict[hf_name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    if dequantised:
        logger.info("%s: dequantised to float32 (no native kernel): %s", path,
                    ", ".join(f"{n} tensors of {k}" for k, n in sorted(dequantised.items())))
    if repacked:
        logger.info("%s: repacked at load (loader/gguf_packed.py): %s", path,
                    ", ".join(f"{n} tensors of {k} into {gguf_packed.REPACKED_FORM[k]}"
                              for k, n in sorted(repacked.items())))
    if arch == gguf_deepseek.ARCH:
        gguf_deepseek.settle(state_dict, config, path)
    if arch == gguf_gpt_oss.ARCH:
        gguf_gpt_oss.read_experts(experts, config, keep_packed, state_dict, packed, path)
    gguf_packed.settle_fused(packed, state_dict, config.num_hidden_layers, path)
    gguf_experts.settle_experts(packed, state_dict, path, expert_types)
    return state_dict, packed


def _expert_layer_name(name: str, config: ModelConfig) -> str | None:
    """The HF key of a MoE layer's router or shared-expert tensor (loader/gguf_experts.py), else None."""
    m = _LAYER_RE.match(name)
    return gguf_experts.layer_name(config.architecture, m.group(1), m.group(2), m.group(3)) \
        if m and config.moe else None


def _read_stacked_experts(t, shape: tuple, stacked: tuple, config: ModelConfig, keep_packed: bool,
                          state_dict: dict, packed: dict, path: str) -> None:
    """One stacked expert tensor [E, rows, K] into per-expert HF keys: packed blocks (and placeholders)
    where they run packed, else float32 views."""
    if len(shape) != 3 or shape[0] != config.moe.experts.num_experts:
        raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(shape)}, expected [experts "
                             f"{config.moe.experts.num_experts}, rows, columns]")
    (count, rows, k), (layer, part) = shape, stacked
    native = gguf_packed.is_native(t.tensor_type)
    if native:
        try:
            qs, scales = gguf_packed.split_blocks(t.data, t.tensor_type, count * rows, k)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from None
        if keep_packed:
            pieces = gguf_experts.split_experts(config.architecture, layer, part, (qs, scales), count)
            for key, (q, sc) in pieces.items():
                packed[key] = (q, sc, k)
                state_dict[key] = gguf_packed.placeholder((rows, k))
            return
        w = gguf_packed.dequantize(qs, scales, k).reshape(shape)
    else:
        try:
            w = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {t.name} uses quantisation {t.tensor_type.name}, which the "
                                 "gguf package cannot dequantise") from None
        w = w.reshape(shape)
    state_dict.update(gguf_experts.split_experts(config.architecture, layer, part, w, count))


def _unpermute(w, hf_name: str, arch: str, config: ModelConfig):
    """Rows of Q and K back in HF order (llama only; any array or tensor with rows first)."""
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return reverse_llama_permute(w, config.num_attention_heads)
    if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return reverse_llama_permute(w, config.num_key_value_heads)
    return w
