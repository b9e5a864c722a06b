"""The model families: one table, from Hugging Face architecture names and GGUF `general.architecture`
names to a family, and what each family sets in a ModelConfig.

A family is data here plus, where its maths differ, a layer kind in config/layers.py with its module
in model/decoder.py. Adding one that fits the existing kinds is one row below: the loaders
(loader/hf.py, loader/gguf.py), the model builder and the executors need no change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from servescope.config.mla import MLA_FIELDS
from servescope.config.moe import DEEPSEEK_FIELDS, GPT_OSS_FIELDS, MIXTRAL_FIELDS, OLMOE_FIELDS, QWEN_MOE_FIELDS

from servescope.config.attention_fields import GEMMA_FIELDS
from servescope.errors import InvalidParameterError


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture, and the Hugging Face model_type
    hf_architecture: str  # config.json "architectures" entry (the first is written by to_hf_dict)
    gguf_architecture: Optional[str] = None  # GGUF general.architecture, None: no GGUF mapping
    # ModelConfig fields a config.json of this family implies when it does not say them itself
    hf_defaults: dict = field(default_factory=dict)
    # ModelConfig fields the family fixes whatever the config says
    fixed: dict = field(default_factory=dict)
    # the checkpoint holds q|k|v and gate|up as one tensor each (self_attn.qkv_proj, mlp.gate_up_proj)
    fused_checkpoint: bool = False
    # config.json fields beyond config/hf_fields.READ that this family reads (any other field that would
    # change the maths is a load error: config/hf_fields.py)
    hf_fields: frozenset = frozenset()
    # which layers attend over a sliding window (config/hf_fields.window_layers): "none" (the family has
    # no window), "all" (every layer, when sliding_window is set), "max_window_layers" (transformers'
    # Qwen2: layers from max_window_layers on, when use_sliding_window), "alternate" (even layers), "every_nth"
    # (Gemma 3: all but every sliding_window_pattern-th layer)
    window_pattern: str = "none"
    # added to every RMSNorm weight at load: Gemma's norms multiply by (1 + w) (llama.cpp's converter adds
    # the 1 to the tensor too), so the model's norms and kernels stay one kind
    norm_offset: float = 0.0
    # the chat template of a checkpoint of this family that has none (tokenizer/family_templates.py), None:
    # the tokenizer's default
    chat_template: Optional[str] = None
    # o_proj has a bias wherever q/k/v have one (gpt-oss's attention_bias covers all four)
    out_bias: bool = False


_WINDOW_ALL = frozenset({"sliding_window"})
_WINDOW_QWEN = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
# what transformers' GptOssConfig assumes of a config.json that does not say it (yarn rope of factor 32 over 4096)
_GPT_OSS_DEFAULTS = {"attention_bias": True, "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "head_dim": 64,
                     "sliding_window": 128, "max_position_embeddings": 131072,
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}}

FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama"),  # Llama 2/3, SmolLM; Mistral GGUFs say "llama" too
    Family("mistral", "MistralForCausalLM", hf_fields=_WINDOW_ALL, window_pattern="all"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", hf_defaults={"attention_bias": True}, hf_fields=_WINDOW_QWEN,
           window_pattern="max_window_layers"),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", fixed={"qk_norm": True}, hf_fields=_WINDOW_QWEN,
           window_pattern="max_window_layers"),
    # fused qkv_proj / gate_up_proj in the checkpoint (our own names: no fusing at load), LongRoPE
    Family("phi3", "Phi3ForCausalLM", "phi3", fused_checkpoint=True, hf_fields=_WINDOW_ALL, window_pattern="all"),
    # mixture-of-experts families (config/moe.py reads their expert fields; Mixtral's GGUFs say "llama" with
    # experts: loader/gguf_experts.py)
    Family("mixtral", "MixtralForCausalLM", hf_fields=_WINDOW_ALL | MIXTRAL_FIELDS, window_pattern="all"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe", hf_defaults={"qkv_bias": True},
           hf_fields=_WINDOW_QWEN | QWEN_MOE_FIELDS, window_pattern="max_window_layers"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", fixed={"qk_norm": True},
           hf_fields=_WINDOW_QWEN | QWEN_MOE_FIELDS, window_pattern="max_window_layers"),
    # q/k RMSNorm over all heads' features at once (not per head)
    Family("olmoe", "OlmoeForCausalLM", "olmoe", fixed={"qk_norm": True, "qk_norm_all_heads": True},
           hf_fields=OLMOE_FIELDS),

    # Gemma 2: (1 + w) norms, four per layer, scaled embeddings, GELU-tanh, soft-capped attention and logits,
    # query_pre_attn_scalar, every other layer windowed; Gemma 3 (text): no soft-caps, q/k norms, five local
    # layers (their own rotary base) to one global
    # (GGUF: loader/gguf_gemma.py reads llama.cpp's names and metadata)
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", hf_fields=GEMMA_FIELDS, window_pattern="alternate",
           norm_offset=1.0, chat_template="gemma", fixed={"norm_placement": "sandwich", "scale_embeddings": True},
           hf_defaults={"tie_word_embeddings": True}),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3", hf_fields=GEMMA_FIELDS, window_pattern="every_nth",
           norm_offset=1.0, chat_template="gemma",
           fixed={"norm_placement": "sandwich", "scale_embeddings": True, "qk_norm": True},
           hf_defaults={"tie_word_embeddings": True}),
    # multi-head latent attention in every layer (config/mla.py reads it: the family's hf_fields name
    # kv_lora_rank), DeepSeek's routers and shared experts (config/moe.py)
    # (GGUF: loader/gguf_deepseek.py reads llama.cpp's deepseek2 files; sigmoid routing makes them deepseek_v3)
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek2",  # (V2's rope always rotates interleaved pairs)
           hf_fields=(MLA_FIELDS - {"rope_interleave"}) | DEEPSEEK_FIELDS),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", hf_fields=MLA_FIELDS | DEEPSEEK_FIELDS),
    # gpt-oss: learned attention sinks, biases on q/k/v and o_proj, every other layer windowed, yarn rope, every
    # layer's MLP experts with gpt-oss's router and clamped SwiGLU (config/moe.py; the checkpoint's interleaved,
    # transposed expert tensors: model/moe.py; GGUF: loader/gguf_gpt_oss.py)
    Family("gpt_oss", "GptOssForCausalLM", "gpt-oss",
           hf_fields=frozenset({"sliding_window", "layer_types"}) | GPT_OSS_FIELDS, window_pattern="alternate",
           hf_defaults=_GPT_OSS_DEFAULTS, fixed={"attention_sinks": True}, out_bias=True),
)}

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_BY_HF = {f.hf_architecture: f for f in FAMILIES.values()}
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise InvalidParameterError("architecture", f"unsupported architecture {name!r}; supported: "
                                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return FAMILIES[name]


def family_of_hf(config: dict) -> Family:
    """The family of a config.json dict: its first known `architectures` entry, else its model_type."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in _BY_HF:
            return _BY_HF[a]
    mt = config.get("model_type")
    if mt in FAMILIES:
        return FAMILIES[mt]
    got = ", ".join(archs) or mt or "none given"
    raise InvalidParameterError(
        "architecture", f"unsupported architecture ({got}); supported: {', '.join(sorted(_BY_HF))} "
                        f"(model_type {', '.join(SUPPORTED_ARCHITECTURES)})")


def family_of_gguf(arch: str) -> Optional[Family]:
    """The family of a GGUF general.architecture, None when there is none."""
    return _BY_GGUF.get(arch)


def gguf_architectures() -> tuple:
    return tuple(_BY_GGUF)
