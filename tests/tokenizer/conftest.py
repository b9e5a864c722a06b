import pytest

from servescope.loader.source import resolve_model_path
from servescope.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf():
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def tok(smollm2_gguf):
    """The SmolLM2 tokenizer (converted from the GGUF; disk-cached across runs)."""
    return load_tokenizer(smollm2_gguf)
