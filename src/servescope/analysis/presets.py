"""Model shape presets: small Hugging Face config.json files (no weights) shipped in presets/.

They let `servescope explain` and the cost model talk about models nobody downloaded. Each file is
the model's own config.json plus a "_source" key naming where it came from.
(This module shadows the presets/ data directory for imports; the directory has no __init__.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

_ALIASES = {
    "llama2-7b": "llama-2-7b", "llama-3-8b-instruct": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "meta-llama-3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b", "mistral-7b-v0.1": "mistral-7b",
    "qwen2.5-7b-instruct": "qwen2.5-7b", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
}


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_hf_dict(name: str) -> dict:
    """The raw config.json dict of a preset."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    path = PRESETS_DIR / f"{key}.json"
    if not path.is_file():
        raise InvalidParameterError("model", f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return json.loads(path.read_text())


def load_preset(name_or_path: Union[str, Path]) -> ModelConfig:
    """A ModelConfig from a preset name ("llama-3-8b"), a config.json path, or a model directory
    holding a config.json."""
    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        try:
            d = json.loads(p.read_text())
        except ValueError as e:
            raise InvalidParameterError("model", f"{p} is not valid JSON: {e}") from e
        return ModelConfig.from_hf_dict(d, name=p.parent.name if p.name == "config.json" else p.stem)
    name = str(name_or_path)
    d = preset_hf_dict(name)
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    return ModelConfig.from_hf_dict(d, name=key)
