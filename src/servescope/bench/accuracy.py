"""How much a weight-quantisation mode and a KV cache dtype change the model: llama.cpp's scoreboard
figures against the float32 model (float32 KV cache) on fixed texts (tests/data/quant_texts.txt): the
mean KL divergence per token of the next-token distributions, KL(float32 || quantised), top-1
agreement, and each side's perplexity.

`accuracy_table(texts, modes, kv_dtypes)` builds one engine per (weights, KV dtype) pair and returns
rows; benchmarks/quant_accuracy.py prints them as the markdown table in docs/BENCHMARKS.md. A
quantised KV cache counts in full here although the text runs as one prefill: every attention path
reads the keys back from the cache, the prompt's own included (model/attention/kv_quant.py).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import torch

from servescope.engine.calibrate import sequence_logits
from servescope.engine.llm import LLM
from servescope.loader.gguf_file import read_gguf


def compare(ref_logits: torch.Tensor, q_logits: torch.Tensor, ids: list) -> dict:
    """Per-token sums over positions 0 .. n-2 (each predicting the next token of `ids`)."""
    lp_ref = torch.log_softmax(ref_logits[:-1].double(), dim=-1)
    lp_q = torch.log_softmax(q_logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:])[:, None]
    kl = (lp_ref.exp() * (lp_ref - lp_q)).sum(dim=-1)
    return {"tokens": len(ids) - 1, "kl": kl.sum().item(), "kl_max": kl.max().item(),
            "top1": (lp_ref.argmax(-1) == lp_q.argmax(-1)).sum().item(),
            "nll_ref": -lp_ref.gather(1, target).sum().item(), "nll_q": -lp_q.gather(1, target).sum().item()}


def accuracy_table(texts: list, modes: list, kv_dtypes: tuple = ("auto",), model=None, saved: tuple = (),
                   **engine_kwargs) -> list:
    """One row per weight mode ("float32": none) and KV cache dtype, modes first: {mode, kv, weight_mib,
    kv_bytes_per_token, kl, kl_max, top1, ppl_ref, ppl} over all texts; the reference is the float32
    model of the same source with a float32 cache. The float32 x auto pair (the reference itself) is skipped.
    saved: quantised forms of `model`, one row each per KV dtype after the modes: directories `servescope
    quantize` wrote, or .gguf files (llama.cpp's `llama-quantize` of the same weights), run from their blocks."""
    kwargs = {"num_kv_blocks": 128, "max_model_len": 2048, **engine_kwargs}
    ref = LLM(model=model, **kwargs)
    seqs = [ref.tokenizer.encode(t) for t in texts]
    ref_logits = [sequence_logits(ref.engine, ids) for ids in seqs]
    rows = []
    runs = [(m, k, model, None if m == "float32" else m) for m in modes for k in kv_dtypes
            if (m, k) != ("float32", "auto")]
    runs += [(_saved_label(path), k, path, "gguf" if _is_gguf(path) else None) for path in saved for k in kv_dtypes]
    for mode, kv, source, quantization in runs:
        q = LLM(model=source, quantization=quantization, kv_cache_dtype=kv, **kwargs)
        parts = [compare(r, sequence_logits(q.engine, ids), ids) for r, ids in zip(ref_logits, seqs)]
        n = sum(p["tokens"] for p in parts)
        rows.append({"mode": mode, "kv": kv, "weight_mib": q.engine.weight_bytes / 2**20, "tokens": n,
                     "kv_bytes_per_token": q.engine.kv_bytes_per_token,
                     "kl": sum(p["kl"] for p in parts) / n, "kl_max": max(p["kl_max"] for p in parts),
                     "top1": sum(p["top1"] for p in parts) / n,
                     "ppl_ref": math.exp(sum(p["nll_ref"] for p in parts) / n),
                     "ppl": math.exp(sum(p["nll_q"] for p in parts) / n)})
        del q
    return rows


def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def _saved_label(path: str) -> str:
    """A saved checkpoint's row name: its mode and method, e.g. "int4-g32-asym (gptq, saved)"; a GGUF
    file's: its most common projection type and file name, e.g. "gguf q4_0 (sd-q4_0-imatrix.gguf)"."""
    if _is_gguf(path):
        return f"gguf {_main_gguf_type(path)} ({os.path.basename(path)})"
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config") or {}
    return f"{qc.get('mode', '?')} ({qc.get('method', '?')}, saved)"


def _main_gguf_type(path: str) -> str:
    """The GGML type most of a file's 2-D weights (by elements) are stored in, lower case ("q4_0")."""
    elements = Counter()
    for t in read_gguf(path).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            elements[t.tensor_type.name.lower()] += int(t.shape[0]) * int(t.shape[1])
    return elements.most_common(1)[0][0] if elements else "?"


def render_markdown(rows: list, ref_mib: float | None = None) -> str:
    head = ("| weights | KV cache | weight MiB | KV bytes / token | mean KL / token | max KL | top-1 agreement | "
            f"perplexity (float32: {rows[0]['ppl_ref']:.3f}) |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    body = "".join(f"| {r['mode']} | {r.get('kv', 'auto')} | {r['weight_mib']:.1f} "
                   f"| {r.get('kv_bytes_per_token', '-')} "
                   f"| {r['kl']:.5f} | {r['kl_max']:.4f} | {100 * r['top1']:.1f}% | {r['ppl']:.3f} |\n" for r in rows)
    return head + body
