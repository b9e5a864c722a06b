"""Our engine against the baselines on the same prompts, for `servescope bench throughput | latency`.

Builds our LLM from an EngineConfig, runs each baseline asked for (transformers, llama.cpp) or says
why it cannot run here, computes the speed ratios (ours / theirs), and assembles the JSON document
of a run: the environment, the workload, our engine's settings, every engine's results, the ratios.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from servescope.bench import baselines as bl
from servescope.bench.datasets import BenchRequest
from servescope.bench.envinfo import environment_info
from servescope.bench.offline import public
from servescope.config import EngineConfig
from servescope.engine.llm import LLM
from servescope.measure.local_hardware import measured_engine

BASELINES = ("hf", "llama-cpp")
DEFAULT_MODEL = "smollm2-135m"  # what EngineConfig(model=None) loads

OnSkip = Optional[Callable[[str, str], None]]  # (baseline, why it cannot run here)


def build_llm(cfg: EngineConfig) -> LLM:
    """Our engine. Its builder sets torch's thread count (cfg.num_threads), which the baselines run
    with too, since they run in this process after it."""
    return LLM.from_engine(measured_engine(cfg))


def engine_description(llm: LLM, cfg: EngineConfig) -> dict:
    """Our engine's settings as a benchmark's JSON records them."""
    e = llm.engine
    return {"model": cfg.model or DEFAULT_MODEL, "source": str(e.source_path),
            "dtype": str(e.dtype).replace("torch.", ""),
            "dtype_requested": cfg.dtype, "device": cfg.device, "quantization": cfg.quantization,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "block_size": cfg.block_size,
            "kv_capacity_tokens": e.cache_config.num_blocks * e.cache_config.block_size,
            "prefix_caching": cfg.enable_prefix_caching, "chunked_prefill": cfg.enable_chunked_prefill,
            "attention_backend": e.runner.backend.name, "weight_bytes": e.weight_bytes}


def benchmark_document(benchmark: str, llm: LLM, cfg: EngineConfig, results: dict, ratios: dict,
                       **sections) -> dict:
    """The JSON of one run: {benchmark, environment..., sections (workload / shape), engine, results, ratios}."""
    return {"benchmark": benchmark, **environment_info(), **sections, "engine": engine_description(llm, cfg),
            "results": public(results), "ratios": ratios}


def llama_cpp_skip_reason(model: Optional[str], batch_size: int = 1) -> Optional[str]:
    """Why the llama.cpp baseline cannot run `model` here (None: it can)."""
    why = bl.llama_cpp_missing_reason()
    if why is None and bl.llama_cpp_gguf_path(model) is None:
        why = "llama.cpp needs a GGUF model; --model is not a .gguf file"
    if why is None and batch_size != 1:
        why = "the llama.cpp baseline measures batch 1 only (its Python API does not batch)"
    return why


def _skip(results: dict, name: str, why: str, on_skip: OnSkip) -> None:
    results[name] = {"skipped": why}
    if on_skip:
        on_skip(name, why)


def _bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)


def run_throughput_baselines(names: Sequence[str], requests: Sequence[BenchRequest], *, model: Optional[str],
                             dtype: str, vocab_size: int, hf_batch_size: int = 16, warmup: bool = True,
                             progress: bool = False, on_start: Optional[Callable[[str], None]] = None,
                             on_skip: OnSkip = None) -> dict:
    """Each named baseline (once, in the order given) on `requests`: {name: results or {"skipped": why}}.
    Each model is loaded, run and freed before the next one loads."""
    results: dict = {}
    for name in dict.fromkeys(names):
        if name == "hf":
            if on_start:
                on_start(name)
            hf = bl.load_hf_model(model, dtype)
            if warmup:
                bl.hf_warm_up(hf, vocab_size)
            bar = _bar(len(requests), "hf requests", progress)
            results["hf"] = bl.run_hf_throughput(hf, requests, hf_batch_size, on_batch=bar.update)
            bar.close()
            del hf
            continue
        why = llama_cpp_skip_reason(model)
        if why:
            _skip(results, "llama-cpp", why, on_skip)
            continue
        if on_start:
            on_start(name)
        gguf = bl.llama_cpp_gguf_path(model)
        n_ctx = max(r.prompt_len + r.output_len for r in requests) + 16
        lc = bl.load_llama_cpp(gguf, n_ctx, torch.get_num_threads())
        bar = _bar(len(requests), "llama.cpp requests", progress)
        results["llama-cpp"] = bl.run_llama_cpp_throughput(lc, requests, on_request=bar.update)
        bar.close()
        results["llama-cpp"]["gguf"] = gguf
        del lc
    return results


def run_latency_baselines(names: Sequence[str], *, model: Optional[str], dtype: str, batch_size: int,
                          input_len: int, output_len: int, vocab_size: int, iters: int = 3, seed: int = 0,
                          warmup: bool = True, on_skip: OnSkip = None) -> dict:
    """Each named baseline (once, in the order given) at one batch shape: {name: results or {"skipped": why}}."""
    results: dict = {}
    for name in dict.fromkeys(names):
        if name == "hf":
            hf = bl.load_hf_model(model, dtype)
            results["hf"] = bl.run_hf_latency(hf, batch_size, input_len, output_len, vocab_size,
                                              iters=iters, seed=seed, warmup=warmup)
            del hf
            continue
        why = llama_cpp_skip_reason(model, batch_size)
        if why:
            _skip(results, "llama-cpp", why, on_skip)
            continue
        lc = bl.load_llama_cpp(bl.llama_cpp_gguf_path(model), input_len + output_len + 16, torch.get_num_threads())
        results["llama-cpp"] = bl.run_llama_cpp_latency(lc, input_len, output_len, vocab_size, iters=iters,
                                                        seed=seed, warmup=warmup)
        del lc
    return results


def _ratios(results: dict, figures: dict) -> dict:
    """{f"{label}_vs_{baseline}": ours / theirs} for each {label: figure} both sides measured, in
    BASELINES order (the JSON's and the printout's)."""
    ours = results["servescope"]
    ratios = {}
    for name in BASELINES:
        r = results.get(name)
        if not r or "skipped" in r:
            continue
        for label, figure in figures.items():
            if r.get(figure) and ours.get(figure):
                ratios[f"{label}_vs_{name}"] = ours[figure] / r[figure]
    return ratios


def throughput_ratios(results: dict) -> dict:
    """servescope's output tokens/s over each baseline's that ran."""
    return _ratios(results, {"output_tokens_per_s": "output_tokens_per_s"})


def latency_ratios(results: dict) -> dict:
    """servescope's decode tokens/s and TTFT over each baseline's that ran (a TTFT ratio < 1 is better)."""
    return _ratios(results, {"decode_tokens_per_s": "decode_tokens_per_s", "ttft": "ttft_s"})
