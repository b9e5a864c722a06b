"""A loaded checkpoint, whatever its format: LoadedSource (config, HF-named tensors, tokenizer
location) and the checks every format's loader runs on its tensors against the config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from servescope.config import ModelConfig
from servescope.config.families import family
from servescope.config.mla import mla_tensor_shapes
from servescope.errors import ModelLoadError
from servescope.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedSource:
    """Everything read from a model source. `state_dict` is in HF key names, on CPU: float32 from a GGUF
    (dequantised), as stored from safetensors (mapped from the files, not read until used)."""

    config: ModelConfig
    state_dict: dict = field(repr=False)  # dict[str, torch.Tensor]
    tokenizer_source: TokenizerSource
    path: str
    format: str  # "hf" | "gguf"
    chat_template: Optional[str] = None
    generation_config: dict = field(default_factory=dict)  # at least "eos_token_id": list[int]
    # GGUF blocks run as they are (loader/gguf_packed.py): {hf name: (packed, float16 scales, K)}; their
    # state_dict entries are placeholders
    packed: dict = field(default_factory=dict, repr=False)

    def num_bytes(self) -> int:
        dense = sum(t.numel() * t.element_size() for k, t in self.state_dict.items() if k not in self.packed)
        return dense + sum(q.numel() * q.element_size() + s.numel() * s.element_size()
                           for q, s, _ in self.packed.values())


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple]:
    """The HF checkpoint keys and shapes a model of this config needs (lm_head absent when tied)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, hd = config.q_size, config.kv_size, config.head_dim
    fused = family(config.architecture).fused_checkpoint
    specs = config.layer_specs()
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        if config.mla:  # latent attention (config/mla.py): its own tensors
            shapes.update(mla_tensor_shapes(config.mla, p, d, config.num_attention_heads, config.attention_bias))
        elif fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, d)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q, d)
            shapes[p + "self_attn.k_proj.weight"] = (kv, d)
            shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        if not config.mla:
            shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if config.attention_bias and not config.mla:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (q,) if config.qk_norm_all_heads else (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (kv,) if config.qk_norm_all_heads else (hd,)
        if specs[layer].mlp.kind == "moe":
            shapes.update(_expert_shapes(config.architecture, p, specs[layer].mlp.experts, d))
        elif fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, d)
            shapes[p + "mlp.down_proj.weight"] = (d, i)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, d)
            shapes[p + "mlp.up_proj.weight"] = (i, d)
            shapes[p + "mlp.down_proj.weight"] = (d, i)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if config.norm_placement == "sandwich":
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
            shapes[p + "post_feedforward_layernorm.weight"] = (d,)
        if config.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_attention_heads,)
    return shapes


def _expert_shapes(architecture: str, prefix: str, experts, d: int) -> dict:
    """A sparse layer's checkpoint tensors: the router, each expert's gate / up / down (Mixtral's w1 / w3 /
    w2 under block_sparse_moe), a shared expert and its gate (model/moe.py stacks the experts at load)."""
    i, s = experts.intermediate_size, experts.shared_intermediate_size
    mixtral = architecture == "mixtral"
    block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if experts.router == "gpt_oss":  # stacked per layer, gate|up interleaved and transposed (model/moe.py)
        n, ex = experts.num_experts, block + "experts."
        return {block + "router.weight": (n, d), block + "router.bias": (n,), ex + "gate_up_proj": (n, d, 2 * i),
                ex + "gate_up_proj_bias": (n, 2 * i), ex + "down_proj": (n, i, d), ex + "down_proj_bias": (n, d)}
    shapes = {block + "gate.weight": (experts.num_experts, d)}
    for e in range(experts.num_experts):
        for name, shape in zip(names, ((i, d), (i, d), (d, i))):
            shapes[f"{block}experts.{e}.{name}.weight"] = shape
    if experts.router == "deepseek_v3":
        shapes[block + "gate.e_score_correction_bias"] = (experts.num_experts,)
    shared = "shared_expert" if experts.shared_gated else "shared_experts"  # DeepSeek's name (ungated)
    if s:
        for name, shape in zip(("gate_proj", "up_proj", "down_proj"), ((s, d), (s, d), (d, s))):
            shapes[f"{block}{shared}.{name}.weight"] = shape
        if experts.shared_gated:
            shapes[block + "shared_expert_gate.weight"] = (1, d)
    return shapes


def check_state_dict(state_dict: dict, config: ModelConfig, where: str) -> dict:
    """Return the state dict restricted to the expected keys; raise ModelLoadError on missing/misshapen ones.

    Extra keys (rotary inv_freq buffers, a tied lm_head saved anyway) are dropped with a debug log.
    """
    expected = expected_tensor_shapes(config)
    missing = [k for k in expected if k not in state_dict]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}")
    for k, shape in expected.items():
        got = tuple(state_dict[k].shape)
        if got != shape:
            raise ModelLoadError(
                f"{where}: shape mismatch for {k}: the file has {list(got)}, the config implies {list(shape)}"
            )
    extra = [k for k in state_dict if k not in expected]
    if extra:
        logger.debug("%s: ignoring %d unused tensors (%s...)", where, len(extra), ", ".join(extra[:3]))
    return {k: state_dict[k] for k in expected}

