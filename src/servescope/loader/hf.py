"""Load a local Hugging Face model directory: config.json, safetensors weights, tokenizer files.

Weights come from `model.safetensors` or from the shards listed in `model.safetensors.index.json`.
Tensors keep their checkpoint names and are converted to float32 (the caller casts). The chat
template is read from `chat_template.jinja` (transformers >= 4.43 saves it there) or from
`tokenizer_config.json`; end-of-sequence ids merge config.json and generation_config.json.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from safetensors import safe_open

from servescope.config import ModelConfig
from servescope.config.families import family
from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.loader import hf_mxfp4, quantized
from servescope.loader.checkpoint import LoadedSource, check_state_dict, expected_tensor_shapes
from servescope.tokenizer.family_templates import family_template
from servescope.tokenizer.source import TokenizerSource

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_dir(path: str) -> LoadedSource:
    """Read a HF directory into a LoadedSource. Raises ModelLoadError naming the file on any problem."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    hf_config = _read_json(config_path)
    try:
        config = ModelConfig.from_hf_dict(hf_config, name=os.path.basename(os.path.normpath(path)))
    except InvalidParameterError as e:
        raise ModelLoadError(f"{config_path}: {e.message}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: incomplete or invalid config ({type(e).__name__}: {e})") from None

    generation_config = _read_generation_config(path, config)
    eos_ids = tuple(generation_config["eos_token_id"])
    mode = quantized.saved_mode(path)
    packed = {}
    if hf_mxfp4.is_mxfp4_config(hf_config):  # gpt-oss as released: MXFP4 experts kept packed
        dense, packed = hf_mxfp4.read_mxfp4(_read_weights(path), expected_tensor_shapes(config),
                                            path)
        state_dict = hf_mxfp4.drop_packed_placeholders(check_state_dict(dense, config, path), packed)
    elif mode is None:
        state_dict = check_state_dict(_read_weights(path), config, path)
    else:  # a `servescope quantize` checkpoint: its packed linears run as they are (loader/quantized.py)
        shapes = expected_tensor_shapes(config)
        shapes.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))  # (tied: a quantised copy)
        dense, packed = quantized.read_packed(_read_weights(path), mode, shapes, path,
                                              tied=config.tie_word_embeddings)
        state_dict = check_state_dict(dense, config, path)
    # a checkpoint without a template of its own gets its family's (Gemma's turns), else the tokenizer's default
    chat_template = _read_chat_template(path) or family_template(family(config.architecture).chat_template)
    return LoadedSource(
        config=config,
        state_dict=state_dict,
        tokenizer_source=TokenizerSource(path=path, chat_template=chat_template, eos_token_ids=eos_ids),
        path=path,
        format="hf",
        chat_template=chat_template,
        generation_config=generation_config,
        packed=packed,
    )


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def _plain_relative(name) -> bool:
    """A path confined to its directory: relative, no '..' part, not a drive or a home directory."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        return False
    if os.path.isabs(name) or name.startswith("~") or ":" in name:
        return False
    return ".." not in name.split("/") and not os.path.normpath(name).startswith("..")


def weight_files(path: str) -> list[str]:
    """The safetensors files of a directory, in shard order. Raises ModelLoadError when there are none."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not _plain_relative(f):
                raise ModelLoadError(f"{index_path}: shard {f!r} is not a file name inside the model directory")
            if not os.path.isfile(os.path.join(path, f)):
                raise ModelLoadError(f"{index_path}: lists shard {f}, which is missing from {path}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(path, f) for f in others]
    hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(
        f.endswith(".bin") for f in os.listdir(path)) else ""
    raise ModelLoadError(f"{path}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE}){hint}")


def _read_weights(path: str) -> dict:
    """Every tensor of the directory's safetensors files, as stored: safetensors maps the files, so a tensor
    costs no memory of its own until it is read (the build copies each into its parameter, in the model's
    dtype, a layer at a time: loader/build.py); a float32 copy of a bfloat16 checkpoint here held twice its
    bytes before the model was even allocated."""
    state_dict = {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    state_dict[key] = f.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError on truncated/corrupt headers, OSError, ...
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({type(e).__name__}: {e})") from None
    return state_dict


def _read_generation_config(path: str, config: ModelConfig) -> dict:
    gen = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
    eos = list(config.eos_token_ids)
    g = gen.get("eos_token_id")
    for i in (g if isinstance(g, list) else [g] if g is not None else []):
        if int(i) not in eos:
            eos.append(int(i))
    out = {k: v for k, v in gen.items() if k in ("bos_token_id", "pad_token_id", "temperature", "top_p", "top_k")}
    out["eos_token_id"] = eos
    if "bos_token_id" not in out and config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    return out


def _read_chat_template(path: str) -> Optional[str]:
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja_path}: cannot read ({e})") from None
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        t = _read_json(tc_path).get("chat_template")
        if isinstance(t, str):
            return t
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            return named.get("default") or next(iter(named.values()), None)
    return None
