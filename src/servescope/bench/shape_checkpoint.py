"""Random-weight checkpoints of real model shapes as files both engines run (`servescope checkpoint`).

`random:<preset>` builds a real shape in memory, which only servescope can run. A side-by-side with
llama.cpp needs the same weights in files: this writes a preset's shape as a Hugging Face directory and,
when llama.cpp's tools are at hand, converts that directory with llama.cpp's own convert_hf_to_gguf.py
and llama-quantize, so a GGUF of each type is the same weights as the directory (and as each other up to
the quantisation).

The directory: config.json (the preset's, with SmolLM2's vocabulary, see below), generation_config.json,
the weights in bfloat16 as safetensors shards of at most SHARD_BYTES with model.safetensors.index.json,
and the embedded SmolLM2's tokenizer (read from its GGUF by transformers). Each tensor is drawn straight
in bfloat16 (normal, std 0.02; norms 1) and written with its shard, so an 8B shape never exists in
float32 and at most one shard is in memory. With `gguf` formats, <out>/gguf/<shape>-<TYPE>.gguf
(F16 from the converter, the others from llama-quantize on it).

The vocabulary is SmolLM2's 49152 tokens, not the shape's own (128256 for Llama 3, 151936 for Qwen3):
the tokenizer must cover the table for llama.cpp's converter and for text in and out of both engines,
and no other tokenizer is on the machine. The layers are the real ones; the embedding and head are
smaller than the real model's (config.json's "_source" says so), which matters most at 1B: Llama-3.2-1B
is 1.24B parameters with its own vocabulary and 1.07B with this one.

Everything is written into a temporary directory beside `out` and renamed into place at the end: a
failure (a bad shape, a full disk, a converter error) leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from servescope.analysis.presets import preset_hf_dict
from servescope.bench.llama_cpp_tools import find_tool
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError, ServescopeError
from servescope.loader.checkpoint import expected_tensor_shapes
from servescope.loader.output_dir import atomic_directory, check_destination

logger = logging.getLogger(__name__)

SHAPES = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-4b")  # the issue's; any preset works
GGUF_TYPES = {"f16": "F16", "q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # --gguf name -> llama.cpp's
SHARD_BYTES = 2 << 30
TOKENIZER_VOCAB = 49152  # SmolLM2's (bos 1, eos 2)
INIT_STD = 0.02
ENV_DIR = "LLAMA_CPP_DIR"  # llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py/, build/bin/)


@dataclass(frozen=True)
class LlamaCppTree:
    """What the GGUF files need: the converter script, its gguf-py, and llama-quantize."""

    converter: str
    gguf_py: str
    quantize: str


@dataclass
class CheckpointReport:
    out: str
    shape: str
    parameters: int
    hf_bytes: int
    ggufs: dict = field(default_factory=dict)  # TYPE -> path
    seconds: dict = field(default_factory=dict)


def shape_config(shape: str, layers: int | None = None) -> dict:
    """The preset's config.json (or a config.json file's) for a random checkpoint: SmolLM2's vocabulary,
    bfloat16, optionally fewer layers (tests). InvalidParameterError for an unknown shape or a bad layer
    count."""
    cfg = {k: v for k, v in _shape_dict(shape).items() if k != "_source"}
    if layers is not None:
        if layers < 1:
            raise InvalidParameterError("layers", f"--layers must be at least 1, got {layers}")
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    real_vocab = cfg.get("vocab_size")
    cfg.update(vocab_size=TOKENIZER_VOCAB, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    cut = "" if layers is None else f" cut to {layers} layers"
    cfg["_source"] = (f"servescope checkpoint {shape}: random weights (normal, std {INIT_STD}) of the "
                      f"preset's shape{cut}, with SmolLM2's vocabulary ({TOKENIZER_VOCAB} tokens; the "
                      f"shape's own is {real_vocab}) and SmolLM2's tokenizer")
    return cfg


def _shape_dict(shape: str) -> dict:
    if not shape.endswith(".json"):
        return preset_hf_dict(shape)
    try:
        with open(shape, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidParameterError("shape", f"cannot read the shape's config {shape}: {e}") from None
    if not isinstance(d, dict):
        raise InvalidParameterError("shape", f"{shape} is not a config.json object")
    return d


def shape_name(shape: str) -> str:
    """The name in the GGUF files' names: the preset's, or the config file's stem."""
    return os.path.splitext(os.path.basename(shape))[0] if shape.endswith(".json") else shape.strip().lower()


def find_llama_cpp(where: str | None) -> LlamaCppTree:
    """llama.cpp's tree from `where` or $LLAMA_CPP_DIR: InvalidParameterError naming what is missing."""
    root = where or os.environ.get(ENV_DIR)
    if not root:
        raise InvalidParameterError(
            "llama_cpp", f"--gguf needs llama.cpp's source tree (convert_hf_to_gguf.py and a build with "
            f"llama-quantize): pass --llama-cpp DIR or set ${ENV_DIR}; docs/BENCHMARKS.md "
            "'llama.cpp's own tools' says how to build it")
    root = os.path.abspath(os.path.expanduser(root))
    converter = os.path.join(root, "convert_hf_to_gguf.py")
    gguf_py = os.path.join(root, "gguf-py")
    if not os.path.isfile(converter) or not os.path.isdir(gguf_py):
        raise InvalidParameterError("llama_cpp", f"{root} is not a llama.cpp source tree (no "
                                    "convert_hf_to_gguf.py and gguf-py/ in it)")
    quantize = os.path.join(root, "build", "bin", "llama-quantize")
    if not os.access(quantize, os.X_OK):
        quantize = find_tool("llama-quantize")
    if quantize is None:
        raise InvalidParameterError("llama_cpp", f"llama-quantize not found in {root}/build/bin, "
                                    "$LLAMA_CPP_BIN or PATH: build it with `cmake --build build --target "
                                    "llama-quantize`")
    return LlamaCppTree(converter, gguf_py, quantize)


def parse_gguf_types(spec: str | None) -> list:
    """'f16,q4_0' -> ['F16', 'Q4_0']; InvalidParameterError for a type not in GGUF_TYPES."""
    if not spec:
        return []
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in GGUF_TYPES]
    if bad or not names:
        raise InvalidParameterError("gguf", f"unknown GGUF type(s) {', '.join(bad) or spec!r}: use a "
                                    f"comma-separated list of {', '.join(GGUF_TYPES)}")
    return list(dict.fromkeys(GGUF_TYPES[n] for n in names))


def write_shape_checkpoint(shape: str, out: str, layers: int | None = None, gguf: str | None = None,
                           llama_cpp: str | None = None, seed: int = 0) -> CheckpointReport:
    """Write `shape` (a preset name) to `out` as described in the module doc; every input is checked
    before the first byte is written."""
    cfg = shape_config(shape, layers)
    types = parse_gguf_types(gguf)
    tree = find_llama_cpp(llama_cpp) if types else None
    out = check_destination(out)  # before the first byte is written (and again when writing)
    try:
        config = ModelConfig.from_hf_dict(cfg, name=shape_name(shape))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidParameterError("shape", f"{shape}: not a usable model config "
                                    f"({type(e).__name__}: {e})") from None
    with atomic_directory(out, ".checkpoint-") as tmp:
        t0 = time.perf_counter()
        params, nbytes = _write_weights(tmp, config, seed)
        _write_metadata(tmp, cfg)
        report = CheckpointReport(out, shape, params, nbytes)
        report.seconds["hf"] = time.perf_counter() - t0
        if tree is not None:
            t0 = time.perf_counter()
            report.ggufs = _write_ggufs(tmp, tree, shape_name(shape), types)
            report.seconds["gguf"] = time.perf_counter() - t0
    report.ggufs = {t: os.path.join(out, os.path.relpath(p, tmp)) for t, p in report.ggufs.items()}
    return report


def _write_weights(tmp: str, config: ModelConfig, seed: int) -> tuple:
    """The safetensors shards and their index; returns (parameters, bytes)."""
    import torch  # lazy: the CLI's --help must not import torch
    from safetensors.torch import save_file  # lazy: as torch

    shapes = expected_tensor_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    weight_map, total, params = {}, 0, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, s, gen) for n, s in names.items()}
        save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, fname), 0o644)  # (as readable as the other files)
        for n, t in tensors.items():
            weight_map[n] = fname
            params += t.numel()
            total += t.numel() * t.element_size()
        del tensors
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return params, total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _random_tensor(name: str, shape, gen):
    import torch  # lazy: as above

    t = torch.empty(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    if name.endswith(".bias"):
        return t.zero_()
    return t.normal_(0.0, INIT_STD, generator=gen)  # drawn in bfloat16: no float32 copy of a large table


def _write_metadata(tmp: str, cfg: dict) -> None:
    """config.json, generation_config.json and the embedded SmolLM2's tokenizer files."""
    from servescope.loader.source import resolve_model_path  # lazy: the loader pulls in torch
    from servescope.tokenizer.hf_tokenizer import load_tokenizer  # lazy: transformers, seconds of import

    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f, indent=2)
    tok = load_tokenizer(resolve_model_path(None)).hf
    if len(tok) != TOKENIZER_VOCAB:
        raise InvalidParameterError("model", f"the embedded tokenizer has {len(tok)} tokens, expected "
                                    f"{TOKENIZER_VOCAB}: the table would not match it")
    tok.save_pretrained(tmp)


def _write_ggufs(tmp: str, tree: LlamaCppTree, shape: str, types: list) -> dict:
    """llama.cpp's converter to F16, then llama-quantize for the other types: {TYPE: path}."""
    gdir = os.path.join(tmp, "gguf")
    os.makedirs(gdir)
    f16 = os.path.join(gdir, f"{shape}-F16.gguf")
    env = {**os.environ, "PYTHONPATH": tree.gguf_py + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _run([sys.executable, tree.converter, tmp, "--outtype", "f16", "--outfile", f16], env,
         "convert_hf_to_gguf.py")
    out = {}
    for t in types:
        if t == "F16":
            out[t] = f16
            continue
        path = os.path.join(gdir, f"{shape}-{t}.gguf")
        _run([tree.quantize, f16, path, t], None, "llama-quantize")
        out[t] = path
    if "F16" not in types:
        os.remove(f16)
    return out


def _run(cmd: list, env, what: str) -> None:
    logger.info("running %s", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout)[-1500:]
        raise ServescopeError(f"{what} failed (exit {r.returncode}); nothing was written:\n{tail}")
