"""Shared fixtures: the embedded SmolLM2 engine (loaded once per session) and tiny models."""

import contextlib
import functools
import os
import sys

import pytest

# tests/model holds the tiny-model builders that many test packages reuse
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "model"))

# Tests run on 2 shared cores: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# A cached probe is read with a spot check of the read bandwidth (analysis/bandwidth.py), which moves with
# this machine's other tenants: off, so that predictions in tests do not; the tests of the spot check hand
# theirs in.
os.environ.setdefault("SERVESCOPE_BANDWIDTH_SPOT_CHECK", "0")
# A probe or kernel table measured while the rest of the machine takes CPU is not cached (analysis/busy.py). The
# suite runs its own niced background jobs (tests/background_jobs.py) beside the tests, so every measurement would
# count as busy and be taken again by every later engine: the sign is off here (tests/analysis/test_busy_window.py
# sets its own figure).
os.environ.setdefault("SERVESCOPE_BUSY_OTHERS_CPUS", "inf")
# The GEMV's row limit for a bfloat16 weight is measured per machine and shape (kernels/cpu/gemv_limits.py): fixed
# at linear.MAX_ROWS here, so that no test's kernel choice depends on a timing (tests/kernels/test_gemv_limits.py
# sets its own).
os.environ.setdefault("SERVESCOPE_GEMV_ROWS", "fixed")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's interpreter. It must be chosen before anything
# imports triton (the model imports its fused kernels at import time), so it is set here, once.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(session, config, items):
    """The modules that hand work to tests/background_jobs.py run last, each in one piece and in its
    place among them: their jobs then have the whole session's idle core to finish in, where in
    path order their tests would wait for them (the tests' own order and fixtures are unchanged)."""
    import background_jobs

    owners = background_jobs.owners()
    items[:] = sorted(items, key=lambda item: getattr(item, "module", None) is not None
                      and item.module.__name__ in owners)


def pytest_collection_finish(session):
    """Start the background jobs (tests/background_jobs.py) of the modules this session runs, in their order."""
    if not session.config.option.collectonly:
        import background_jobs

        background_jobs.start([item.module.__name__ for item in session.items if getattr(item, "module", None)])


def pytest_unconfigure(config):
    import background_jobs

    background_jobs.stop()


@pytest.fixture(scope="session")
def smollm2_llm():
    """The embedded model in float32 with a small KV cache, shared by the end-to-end tests.
    Tests must leave it idle (every request finished or aborted)."""
    from servescope import LLM

    llm = LLM(num_kv_blocks=512, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512)
    yield llm
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_llm):
    """smollm2_engine(**settings): what LLMEngine(**settings) builds, on the session's SmolLM2 weights
    (loading them again costs seconds): its own settings, KV cache and scheduler."""
    from servescope.config import EngineConfig

    def build(**settings):
        return smollm2_llm.engine.with_config(**EngineConfig(**settings).flat())
    return build


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own load of the same GGUF (dequantised to float32), the reference."""
    from transformers import AutoModelForCausalLM

    from servescope.loader.source import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype="float32")
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF load parses the file with gguf-py twice (for the config, then the weights) and
    builds gguf-py's tensor-name map once per tensor (397 times): about half of its ~27 s here. Both are
    pure functions of their arguments, so during the load each runs once; the weights, their
    dequantisation and the model are transformers' own."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def read_once(path, mode="r"):
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
