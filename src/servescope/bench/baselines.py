"""What users would run instead, on the same prompts in the same process: transformers and llama.cpp.

transformers (`--baseline hf`): `model.generate` on padded static batches, as one would write it
without a serving engine. Prompts are left-padded to the longest in the batch; greedy; every
sequence runs to the batch's largest requested output length (min_new_tokens = max_new_tokens, the
equivalent of ignore_eos). Only the tokens each request asked for count as useful output; the
padded extra tokens are reported separately (`generated_tokens`) and do not count in tokens/s.
Same dtype and the same torch thread count as our engine (same process).

llama.cpp (`--baseline llama-cpp`): `llama-cpp-python` on the same GGUF file (its own quantised
weights: for the embedded SmolLM2, 4-bit Q4_1), one request at a time (its Python API has no
continuous batching), greedy, stopping only at the requested length.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from servescope.analysis.presets import load_preset
from servescope.bench.datasets import BenchRequest
from servescope.bench.latency import latency_prompts
from servescope.bench.offline import throughput_figures
from servescope.loader.source import resolve_model_path

LLAMA_CPP_INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF '
    '-DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python'
)

# ----------------------------------------------------------------------------------- transformers

HF_MIN_DECODE_TOKENS = 8  # below this the transformers decode rate (a difference of two runs) is noise


def hf_model_source(model: Optional[str]) -> dict:
    """How transformers loads the model servescope calls `model`: from_pretrained kwargs or a config."""
    if model and model.startswith("random:"):
        return {"kind": "random", "preset": model[len("random:"):]}
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return {"kind": "dir", "path": path}
    return {"kind": "gguf", "path": os.path.dirname(path) or ".", "gguf_file": os.path.basename(path)}


def load_hf_model(model: Optional[str], dtype: str = "float32"):
    """transformers' AutoModelForCausalLM on the same weights as servescope's `model` argument.

    The embedded GGUF (or any .gguf) loads with `gguf_file=` (transformers dequantises it; needs
    `accelerate`); an HF directory loads directly; `random:PRESET` builds the preset's config with
    random weights (timing only).
    """
    # lazy: the transformers model classes take 1 s to import (after torch), paid only by the runs
    # that ask for the hf baseline
    from transformers import AutoConfig, AutoModelForCausalLM

    tdtype = getattr(torch, dtype)
    src = hf_model_source(model)
    if src["kind"] == "random":
        d = load_preset(src["preset"]).to_hf_dict()
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=tdtype)
    elif src["kind"] == "dir":
        hf = AutoModelForCausalLM.from_pretrained(src["path"], dtype=tdtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(src["path"], gguf_file=src["gguf_file"], dtype=tdtype)
    return hf.to(tdtype).eval()


def _pad_id(hf) -> int:
    gc = getattr(hf, "generation_config", None)
    for v in (getattr(gc, "pad_token_id", None), getattr(hf.config, "pad_token_id", None),
              getattr(gc, "eos_token_id", None), getattr(hf.config, "eos_token_id", None)):
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def hf_generate_batch(hf, prompts: Sequence[Sequence[int]], new_tokens: int):
    """One left-padded greedy batch producing exactly `new_tokens` tokens per row; returns [B, new]."""
    pad = _pad_id(hf)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: the last prompt token sits in the last column
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                          num_beams=1, use_cache=True)
    return out[:, width:]


def hf_warm_up(hf, vocab_size: int) -> None:
    g = torch.Generator().manual_seed(12345)
    hf_generate_batch(hf, torch.randint(0, vocab_size, (2, 16), generator=g).tolist(), 4)


def run_hf_throughput(hf, requests: Sequence[BenchRequest], batch_size: int = 16,
                      on_batch: Optional[Callable[[int], None]] = None) -> dict:
    """The requests in order, in static batches of `batch_size`; see the module doc for what counts."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        new = max(r.output_len for r in batch)
        out = hf_generate_batch(hf, [r.prompt for r in batch], new)
        generated += out.numel()
        if on_batch is not None:
            on_batch(len(batch))
    wall = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    res = throughput_figures(len(requests), sum(r.prompt_len for r in requests), useful, wall)
    res.update({"batch_size": batch_size, "generated_tokens": generated,
                "note": "padded static batches: every row runs to its batch's longest output; only the "
                        "requested output tokens count in output_tokens"})
    return res


def run_hf_latency(hf, batch_size: int, input_len: int, output_len: int, vocab_size: int, iters: int = 3,
                   seed: int = 0, warmup: bool = True) -> dict:
    """TTFT = generate(max_new_tokens=1); decode = (time(out) - time(1)) / (out - 1) per step."""
    if warmup:
        w = latency_prompts(batch_size, input_len, output_len, vocab_size, seed + 10_000)
        hf_generate_batch(hf, [r.prompt for r in w], min(output_len, 4))
    ttfts, totals = [], []
    for it in range(iters):
        prompts = [r.prompt for r in latency_prompts(batch_size, input_len, output_len, vocab_size, seed + it)]
        t0 = time.perf_counter()
        hf_generate_batch(hf, prompts, 1)
        ttfts.append(time.perf_counter() - t0)
        if output_len > 1:
            t0 = time.perf_counter()
            hf_generate_batch(hf, prompts, output_len)
            totals.append(time.perf_counter() - t0)
    ttft = statistics.median(ttfts)
    res = {"ttft_s": ttft, "tpot_s": None, "decode_tokens_per_s": None, "e2e_s": None,
           "iterations": [{"ttft_s": a, "e2e_s": b} for a, b in zip(ttfts, totals + [None] * len(ttfts))]}
    if totals:
        e2e = statistics.median(totals)
        res.update({"e2e_s": e2e, "output_tokens_per_s": batch_size * output_len / e2e})
        # the decode time is a difference of two runs that both prefill: with few new tokens it is
        # mostly noise (or negative), so no decode rate is derived from it
        if output_len >= HF_MIN_DECODE_TOKENS and e2e > ttft:
            tpot = (e2e - ttft) / (output_len - 1)
            res.update({"tpot_s": tpot, "decode_tokens_per_s": batch_size / tpot})
        else:
            res["note"] = (f"no decode rate: it needs --output-len >= {HF_MIN_DECODE_TOKENS} (the decode time is "
                           f"time(out) - time(1))")
    return res


# ----------------------------------------------------------------------------------- llama.cpp


def llama_cpp_missing_reason() -> Optional[str]:
    """None when llama_cpp imports; otherwise a message saying how to install it."""
    try:
        # lazy: llama-cpp-python is an optional baseline, not a dependency; importing it is the test
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken shared library (OSError)
        return (f"llama-cpp-python is not usable here ({type(e).__name__}: {e}); it compiles from source "
                f"(about 10 minutes); on CPUs with AMX use: {LLAMA_CPP_INSTALL}")
    return None


def llama_cpp_gguf_path(model: Optional[str]) -> Optional[str]:
    """The GGUF file llama.cpp can run for `model` (None when the model is not a GGUF)."""
    if model and model.startswith("random:"):
        return None
    path = resolve_model_path(model)
    return path if os.path.isfile(path) and path.lower().endswith(".gguf") else None


def load_llama_cpp(gguf_path: str, n_ctx: int, threads: int):
    from llama_cpp import Llama  # lazy: an optional baseline (llama_cpp_missing_reason says how to get it)

    return Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 verbose=False)


def _llama_cpp_one(llm, prompt: Sequence[int], new_tokens: int) -> tuple:
    """Greedy generation of exactly `new_tokens` tokens; returns (ttft_s, total_s)."""
    llm.reset()
    t0 = time.perf_counter()
    ttft = None
    n = 0
    for _ in llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                          reset=True):
        n += 1
        if ttft is None:
            ttft = time.perf_counter() - t0
        if n >= new_tokens:
            break
    return ttft, time.perf_counter() - t0


def run_llama_cpp_throughput(llm, requests: Sequence[BenchRequest],
                             on_request: Optional[Callable[[int], None]] = None) -> dict:
    t0 = time.perf_counter()
    for r in requests:
        _llama_cpp_one(llm, r.prompt, r.output_len)
        if on_request is not None:
            on_request(1)
    wall = time.perf_counter() - t0
    res = throughput_figures(len(requests), sum(r.prompt_len for r in requests),
                             sum(r.output_len for r in requests), wall)
    res["note"] = "llama-cpp-python, one request at a time (no batching in its Python API), its own GGUF weights"
    return res


def run_llama_cpp_latency(llm, input_len: int, output_len: int, vocab_size: int, iters: int = 3,
                          seed: int = 0, warmup: bool = True) -> dict:
    """Batch 1 only: TTFT and decode rate of one request."""
    if warmup:
        w = latency_prompts(1, input_len, output_len, vocab_size, seed + 10_000)[0]
        _llama_cpp_one(llm, w.prompt, min(output_len, 4))
    runs = []
    for it in range(iters):
        p = latency_prompts(1, input_len, output_len, vocab_size, seed + it)[0]
        runs.append(_llama_cpp_one(llm, p.prompt, output_len))
    ttft = statistics.median(t for t, _ in runs)
    e2e = statistics.median(e for _, e in runs)
    res = {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": None, "decode_tokens_per_s": None,
           "iterations": [{"ttft_s": t, "e2e_s": e} for t, e in runs]}
    if output_len > 1:
        tpot = statistics.median((e - t) / (output_len - 1) for t, e in runs)
        res.update({"tpot_s": tpot, "decode_tokens_per_s": 1.0 / tpot})
    return res
