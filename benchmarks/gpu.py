#!/usr/bin/env python
"""One script for a lent GPU (written for an H200): correctness first, then speed.

  python benchmarks/gpu.py                # full run, well under 8 minutes on an H200
  python benchmarks/gpu.py --quick        # fewer tokens
  python benchmarks/gpu.py --dry-run-cpu  # everything tiny on the CPU (torch backend; Triton kernels
                                          # in the interpreter): a smoke test of this script
  python benchmarks/gpu.py --quick --only 8b_batch1,8b_b1_anatomy   # a rerun of a few sections

Sections (each has a timeout, of CPU time in a dry run, and its own try/except, so one failure keeps the
rest of the table):
  kernels        Triton store/decode kernels vs the torch reference; decode kernel GB/s
  moe_kernels    Triton grouped GEMMs of a MoE layer (Qwen3-30B-A3B shape) vs the per-expert torch loop
  prefill        Triton paged prefill attention vs the torch reference (error); TFLOP/s at Llama-3-8B's shape
                 against the reference backend and SDPA's flash kernel (fresh prompts, chunks over context)
  hardware       device-to-device copy bandwidth, bf16 matmul rate (8192^3)
  vs_hf_*        our engine (random weights) vs transformers LlamaForCausalLM with the same
                 weights: greedy tokens equal, per-token logprobs; CUDA-graph vs eager decode
  8b_*           Llama-3-8B shaped, bf16, random weights: batch-1 decode tokens/s and GB/s,
                 where a batch-1 step's time goes (8b_b1_anatomy: graph replay, lm_head, host gap,
                 the matmuls alone, kernel families), the Triton GEMV against cuBLAS
                 (8b_gpu_linear: per shape, then batch-1 decode), throughput at batch 64 and 256,
                 transformers generate for the ratio
The table is printed at the end and written to $OUT/gpu_results.json when OUT is set.
No weights and no network: models are random-initialised from shipped config presets.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback

if "--dry-run-cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any import of triton

import torch  # noqa: E402

from servescope import LLM, SamplingParams  # noqa: E402
from servescope.timing import median_seconds  # noqa: E402

T_START = time.perf_counter()
CPU_START = time.process_time()
ROWS: list = []  # {"section", "metric", "value", "unit", "note"}
SECTIONS: list = []  # {"section", "status", "seconds", "error"}
STATE: dict = {}  # objects shared between sections (the 8B engine)


class SectionTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise SectionTimeout("section timed out")


def record(section: str, metric: str, value, unit: str = "", note: str = "") -> None:
    if isinstance(value, float):
        value = float(f"{value:.6g}")
    ROWS.append({"section": section, "metric": metric, "value": value, "unit": unit, "note": note})


def run_section(name: str, fn, timeout_s: int, budget_s: float, cpu_clock: bool = False) -> None:
    """cpu_clock: the section's timeout and the budget count this process's CPU time (all threads), not
    the wall clock: a dry run in the test suite runs niced in the background, where it may wait for a
    core for minutes doing nothing wrong (one that hangs without using CPU is ended by its waiter)."""
    clock, itimer, signum = ((time.process_time, signal.ITIMER_PROF, signal.SIGPROF) if cpu_clock
                             else (time.perf_counter, signal.ITIMER_REAL, signal.SIGALRM))
    left = budget_s - (clock() - (CPU_START if cpu_clock else T_START))
    if left < 10:
        SECTIONS.append({"section": name, "status": "skipped", "seconds": 0.0, "error": "time budget spent"})
        return
    t0 = time.perf_counter()
    status, err = "ok", ""
    signal.signal(signum, _alarm)
    signal.setitimer(itimer, max(1, int(min(timeout_s, left))))
    try:
        fn(lambda metric, value, unit="", note="": record(name, metric, value, unit, note))
    except SectionTimeout:
        status, err = "timeout", f"over {timeout_s} s"
    except Exception as e:  # keep going: the table is the product
        status, err = "error", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        signal.setitimer(itimer, 0)
    if status == "ok" and any(r["section"] == name and r["metric"].endswith("_ok") and r["value"] is False
                              for r in ROWS):
        status = "FAIL"
    secs = time.perf_counter() - t0
    SECTIONS.append({"section": name, "status": status, "seconds": round(secs, 1), "error": err})
    print(f"[{time.perf_counter() - T_START:6.1f}s] {name}: {status} in {secs:.1f}s {err}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ helpers


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    return median_seconds(fn, iters, warmup, cuda=dev.type == "cuda")


def write_config(cfg_dict: dict, tmp: str, name: str) -> str:
    """A config.json for `random:<path>` specs (a preset with fewer layers, or a tiny model)."""
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    return d


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def ours_generate(llm, prompts, max_tokens: int, logprobs: bool = False):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    secs = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs] if logprobs else None
    return toks, lps, secs


def hf_state_dict(model, cfg) -> dict:
    """Our (possibly fused) parameters under Hugging Face names, as views: no copy."""
    q, kv = cfg.q_size, cfg.kv_size
    sd = {}
    for name, t in model.state_dict().items():
        if ".qkv_proj." in name:
            pre, kind = name.split("qkv_proj.")
            for part, x in zip(("q_proj.", "k_proj.", "v_proj."), t.split([q, kv, kv], dim=0)):
                sd[pre + part + kind] = x
        elif ".gate_up_proj." in name:
            pre, kind = name.split("gate_up_proj.")
            gate, up = t.chunk(2, dim=0)
            sd[pre + "gate_proj." + kind], sd[pre + "up_proj." + kind] = gate, up
        else:
            sd[name] = t
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])  # tied embeddings
    return sd


def hf_from_ours(model, cfg, device):
    """transformers LlamaForCausalLM sharing our weights (assigned views; only rotary tables new)."""
    import transformers

    d = cfg.to_hf_dict()
    d.pop("eos_token_id", None)  # never stop early: compare fixed-length greedy runs
    d.pop("bos_token_id", None)
    hf_cfg = transformers.LlamaConfig(**d)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(hf_state_dict(model, cfg), strict=False, assign=True)
    # rotary inv_freq is a non-persistent buffer, still on meta: rebuild it on the host, then move
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers model has tensors without weights: {left[:4]}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


@torch.inference_mode()
def hf_generate(hf, prompts, max_new: int, device, logits: bool = False):
    """Greedy generate, left-padded batch. Returns (tokens per prompt, raw logprobs or None, seconds)."""
    b, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((b, L), dtype=torch.long)
    mask = torch.zeros((b, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                      do_sample=False, pad_token_id=0, output_logits=logits, return_dict_in_generate=True)
    sync(device)
    secs = time.perf_counter() - t
    toks = out.sequences[:, L:].tolist()
    lps = None
    if logits:
        steps = torch.stack(out.logits, dim=1).float()  # [B, n, V] raw logits
        lp = torch.log_softmax(steps, dim=-1).gather(-1, out.sequences[:, L:, None]).squeeze(-1)
        lps = lp.tolist()
    return toks, lps, secs


def compare_runs(rec, name: str, toks_a, lps_a, toks_b, lps_b, lp_tol: float, need_equal: bool):
    """Greedy tokens equal per prompt; max |logprob diff| over the tokens before any divergence."""
    n_eq = sum(a == b for a, b in zip(toks_a, toks_b))
    first = []
    worst = 0.0
    for i, (a, b) in enumerate(zip(toks_a, toks_b)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if k < len(a):
            first.append(f"prompt {i} at token {k}")
        if lps_a is not None and lps_b is not None:
            upto = min(k + 1, len(lps_a[i]), len(lps_b[i]))  # the diverging step's logprob still compares
            for j in range(upto):
                worst = max(worst, abs(lps_a[i][j] - lps_b[i][j]))
    rec(f"{name}_tokens_equal", f"{n_eq}/{len(toks_a)}", "prompts",
        ("first mismatch: " + ", ".join(first)) if first else "")
    if lps_a is not None and lps_b is not None:
        rec(f"{name}_max_logprob_diff", worst, "nats")
    ok = (n_eq == len(toks_a) or not need_equal) and worst <= lp_tol
    rec(f"{name}_ok", ok, "", f"tokens must be equal: {need_equal}; logprob tol {lp_tol}")


# ------------------------------------------------------------------------------------------ sections


def section_env(rec):
    import transformers

    rec("python", platform.python_version())
    rec("torch", torch.__version__)
    rec("transformers", transformers.__version__)
    try:
        import triton

        rec("triton", triton.__version__)
    except ImportError:
        rec("triton", "missing")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec("gpu", p.name, "", f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")


def section_kernels(rec, dev, dry):
    from servescope.model.attention.reference import TorchAttentionBackend
    from servescope.kernels.triton.attention import paged_decode, store_kv

    g = torch.Generator(device="cpu").manual_seed(0)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
    dtypes = [torch.float32, torch.bfloat16] + ([] if dry else [torch.float16])
    worst = {}
    ok = True
    shapes = [(64, 16, 1), (128, 16, 4), (128, 32, 3)] if not dry else [(64, 16, 3)]
    for d, s, group in shapes:
        for dt in dtypes:
            hkv, n = 2, 64 if not dry else 16
            lens = [1, s, 3 * s + 7, 700] if not dry else [1, s, 37]
            if not dry:
                lens.append(4000)
            n = max(n, sum((x + s - 1) // s for x in lens))
            kc = torch.randn(n, s, hkv, d, generator=g).to(dt).to(dev)
            vc = torch.randn(n, s, hkv, d, generator=g).to(dt).to(dev)
            perm = torch.randperm(n, generator=g).tolist()
            m = max((x + s - 1) // s for x in lens)
            rows, at = [], 0
            for x in lens:
                k = (x + s - 1) // s
                rows.append(perm[at:at + k] + [0] * (m - k))
                at += k
            bt = torch.tensor(rows, dtype=torch.int32, device=dev)
            cl = torch.tensor(lens, dtype=torch.int32, device=dev)
            q = torch.randn(len(lens), hkv * group, d, generator=g).to(dt).to(dev)
            ref = TorchAttentionBackend._paged_decode(q, kc, vc, bt, cl, max(lens), d ** -0.5)
            for splits in (None, 1):  # chosen split-K and single pass
                out = paged_decode(q, kc, vc, bt, cl, d ** -0.5, max_context_len=max(lens), num_splits=splits)
                err = (out.float() - ref.float()).abs().max().item()
                key = str(dt).replace("torch.", "")
                worst[key] = max(worst.get(key, 0.0), err)
                ok &= err <= tol[dt] * 4
            # store kernel vs index_copy (bit-exact)
            t = 5
            kk = torch.randn(t, hkv, d, generator=g).to(dt).to(dev)
            slots = torch.randperm(n * s, generator=g)[:t].to(dev)
            a, b = kc.clone(), kc.clone()
            store_kv(kk, kk, a, a.clone(), slots)
            b.view(n * s, hkv, d).index_copy_(0, slots, kk)
            ok &= bool(torch.equal(a, b))
    for k, v in worst.items():
        rec(f"decode_max_abs_err_{k}", v)
    rec("kernels_ok", bool(ok), "", "decode vs torch reference (D 64/128, S 16/32, GQA 1/3/4); store bit-exact")
    if dry:
        return
    # speed at Llama-3-8B shapes (Hkv 8, D 128, G 4, S 16, bf16): KV bytes read / kernel time
    for bsz, ctx in ((1, 32768), (64, 2048), (256, 512)):
        s, hkv, d = 16, 8, 128
        nblk = ctx // s
        kc = torch.randn(bsz * nblk, s, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(bsz * nblk, device=dev).view(bsz, nblk).int()
        cl = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(bsz, 32, d, device=dev, dtype=torch.bfloat16)
        secs = timed(lambda: paged_decode(q, kc, vc, bt, cl, d ** -0.5, max_context_len=ctx), dev, 20)
        secs8 = timed(lambda: paged_decode(q, kc, vc, bt, cl, d ** -0.5, max_context_len=ctx, num_warps=8), dev, 20)
        ref_secs = timed(lambda: TorchAttentionBackend._paged_decode(q, kc, vc, bt, cl, ctx, d ** -0.5), dev, 5)
        gbs = 2 * kc.numel() * kc.element_size() / secs / 1e9
        rec(f"decode_kernel_b{bsz}_ctx{ctx}", gbs, "GB/s", f"{secs * 1e6:.0f} us; torch ref {ref_secs * 1e6:.0f} us")
        diff = (paged_decode(q, kc, vc, bt, cl, d ** -0.5, max_context_len=ctx, num_warps=8).float()
                - paged_decode(q, kc, vc, bt, cl, d ** -0.5, max_context_len=ctx).float()).abs().max().item()
        rec(f"decode_kernel_b{bsz}_ctx{ctx}_8warps", 2 * kc.numel() * kc.element_size() / secs8 / 1e9, "GB/s",
            f"{secs8 * 1e6:.0f} us (4 warps spill 84 bytes at D 128, 8 do not); max diff to 4 warps {diff:.2g}")
        kc = vc = None  # frees them before the next shape allocates (not del: the lambdas close over them)


def section_quant_kernels(rec, dev, dry):
    """The Triton GEMV over packed int4 / int8 weights (kernels/triton_quant.py): error against the
    dequantised float64 product, then its read rate at Llama-3-8B's MLP shape beside a bf16 matmul."""
    from servescope.kernels.triton import quant as tq
    from servescope.quant.packed import dequantize, quantize
    from servescope.quant.scheme import QuantScheme

    g = torch.Generator(device="cpu").manual_seed(0)
    n, k = (96, 200) if dry else (4096, 14336)
    worst = 0.0
    for scheme in (QuantScheme(4, 32), QuantScheme(4, 32, asym=True), QuantScheme(8, 32)):
        w = torch.randn(n, k, generator=g) * 0.02
        packed, scales = quantize(w, scheme)
        x = torch.randn(1, k, generator=g)
        ref = x.double() @ dequantize(packed, scales, k, torch.float64).T
        pk, sc, xd = packed.to(dev), scales.to(dev), x.to(dev)
        y = tq.quant_gemv(xd, pk, sc, k)
        worst = max(worst, ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item())
        if dry:
            continue
        secs = timed(lambda: tq.quant_gemv(xd, pk, sc, k), dev, 50)
        nbytes = pk.numel() * pk.element_size() + sc.numel() * 2
        name = f"int{scheme.bits}{'_asym' if scheme.asym else ''}"
        rec(f"quant_gemv_{name}_{n}x{k}", nbytes / secs / 1e9, "GB/s",
            f"{secs * 1e6:.0f} us for {nbytes / 2**20:.1f} MiB")
    rec("quant_gemv_max_rel_err", worst, "", "vs the dequantised float64 product (int4 sym/asym, int8; g32)")
    if not dry:
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        xb = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        secs = timed(lambda: xb @ wb.T, dev, 50)
        rec(f"bf16_matmul_{n}x{k}", wb.numel() * 2 / secs / 1e9, "GB/s", f"{secs * 1e6:.0f} us (cuBLAS, M = 1)")


def section_moe_kernels(rec, dev, dry):
    """The Triton grouped GEMMs of a mixture of experts (kernels/triton/moe.py) against the per-expert torch
    loop, at Qwen3-30B-A3B's layer shape (128 experts of width 768, 8 per token) in bfloat16: error, step time
    at 1 / 16 / 256 tokens, and the bytes of the experts read per second at 1 token."""
    from servescope.kernels import fused_ops
    from servescope.kernels.triton import moe as tm
    from servescope.model.moe import grouped_experts, Experts

    e, k, dm, width = (8, 2, 64, 32) if dry else (128, 8, 2048, 768)
    dt = torch.float32 if dry else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    ex = Experts(e, dm, width)
    ex.gate_up_proj.data = (torch.randn(e, 2 * width, dm, generator=g) * dm ** -0.5).to(dev, dt)
    ex.down_proj.data = (torch.randn(e, dm, width, generator=g) * width ** -0.5).to(dev, dt)
    for t in (1, 16) if dry else (1, 16, 256):
        x = torch.randn(t, dm, generator=g).to(dev, dt)
        weights, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, -1)
        ids, weights = ids.to(dev), weights.to(dev, dt)
        fused = lambda: tm.fused_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, fused_ops.silu_mul)  # noqa: E731
        ref, _ = grouped_experts(x, ids, weights, ex)
        got, _ = fused()
        rec(f"moe_fused_t{t}_max_rel_err", ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
            "", "vs the per-expert torch loop")
        if dry:
            continue
        s_fused, s_loop = timed(fused, dev, 30), timed(lambda: grouped_experts(x, ids, weights, ex), dev, 30)
        rec(f"moe_fused_t{t}", s_fused * 1e6, "us", f"torch loop {s_loop * 1e6:.0f} us ({s_loop / s_fused:.2f}x)")
        if t == 1:
            read = k * 3 * dm * width * 2
            rec("moe_fused_t1_read", read / s_fused / 1e9, "GB/s", f"{k} experts' {read / 2**20:.1f} MiB")


def _prefill_step(seqs, s, hkv, h, d, dt, kv_dt, dev, g):
    """A prefill-only step over a paged cache: [(query_len, context_len after the step)] -> (meta, q, k, v, kc, vc),
    the context before each chunk random, the chunk's own keys stored by the reference (as a step does)."""
    from servescope.model.attention import kv_quant
    from servescope.model.attention.backend import AttentionMetadata
    from servescope.model.attention.reference import TorchAttentionBackend

    m = max(-(-c // s) for _, c in seqs)
    n = sum(-(-c // s) for _, c in seqs)
    kc, vc = (kv_quant.allocate(n, s, hkv, d, kv_dt, dev) for _ in range(2))
    perm = torch.randperm(n, generator=g).tolist()
    rows, slots, qsl, at = [], [], [0], 0
    for ql, cl in seqs:
        need = -(-cl // s)
        rows.append(perm[at:at + need] + [0] * (m - need))
        at += need
        slots.append([rows[-1][p // s] * s + p % s for p in range(cl)])
        qsl.append(qsl[-1] + ql)
    tables = torch.tensor(rows, dtype=torch.int32, device=dev)
    all_slots = torch.tensor([x for row in slots for x in row], dtype=torch.int64, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([x for row, (ql, _) in zip(slots, seqs) for x in row[len(row) - ql:]],
                                  dtype=torch.int64, device=dev),
        block_tables=tables, context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        query_lens_cpu=[q for q, _ in seqs], context_lens_cpu=[c for _, c in seqs],
        max_query_len=max(q for q, _ in seqs), max_context_len=max(c for _, c in seqs))
    every = AttentionMetadata(slot_mapping=all_slots, block_tables=tables, context_lens=meta.context_lens,
                              query_start_loc=meta.query_start_loc, query_lens_cpu=[], context_lens_cpu=[],
                              max_query_len=0, max_context_len=0)
    qd = torch.float32 if kv_quant.is_quantized(kv_dt) else dt
    ref = TorchAttentionBackend()
    ref.store_kv(*(torch.randn(len(all_slots), hkv, d, generator=g).to(dev, qd) for _ in range(2)), kc, vc, every)
    t = qsl[-1]
    q = torch.randn(t, h, d, generator=g).to(dev, qd)
    k, v = (torch.randn(t, hkv, d, generator=g).to(dev, qd) for _ in range(2))
    ref.store_kv(k, v, kc, vc, meta)
    return meta, q, k, v, kc, vc


def _prefill_check(rec, dev, dry) -> None:
    """The Triton prefill kernel against the torch reference (SDPA; scores.attend with soft-caps and sinks)."""
    from servescope.kernels.triton.prefill import paged_prefill
    from servescope.model.attention import kv_quant
    from servescope.model.attention.reference import TorchAttentionBackend

    g = torch.Generator(device="cpu").manual_seed(0)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
    seqs = [(19, 19), (7, 40), (1, 23)] if dry else [(300, 300), (77, 1000), (1, 50), (129, 129), (512, 700)]
    kv_dtypes = [torch.float32, torch.bfloat16, torch.int8] + ([] if dry else [torch.float16])
    d, group, hkv = (64, 2, 2) if dry else (128, 4, 2)
    mods_list = [{}, dict(window=16 if dry else 256, softcap=4.0, sinks=torch.linspace(-4, 4, hkv * group))]
    ok, worst = True, {}
    for kv_dt in kv_dtypes:
        meta, q, k, v, kc, vc = _prefill_step(seqs, 16, hkv, hkv * group, d, torch.float32 if
                                              kv_quant.is_quantized(kv_dt) else kv_dt, kv_dt, dev, g)
        for mods in mods_list:
            mods = {key: (x.to(dev) if torch.is_tensor(x) else x) for key, x in mods.items()}
            want = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d ** -0.5, **mods)
            got = paged_prefill(q, kc, vc, meta.block_tables, meta.context_lens, meta.query_start_loc, d ** -0.5,
                                max_query_len=meta.max_query_len, **mods)
            err = (got.float() - want.float()).abs().max().item()
            name = str(kv_dt).replace("torch.", "")
            worst[name] = max(worst.get(name, 0.0), err)
            ok &= err <= 4 * tol.get(q.dtype, 2e-5)
    for name, err in worst.items():
        rec(f"prefill_max_abs_err_{name}", err)
    rec("prefill_ok", bool(ok), "", f"vs torch reference (D {d}, GQA {group}, S 16; plain, and window + soft-cap + "
        "sinks; chunks over context, fresh prompts, one token)")


def section_prefill(rec, dev, dry):
    """The Triton paged prefill kernel (kernels/triton/prefill.py): correct against the torch reference, then its
    time at Llama-3-8B's attention shape (H 32, Hkv 8, D 128, bf16, S 16) against the reference backend (one SDPA
    per sequence over its gathered K/V: what the Triton backend ran before) and, for fresh prompts, against
    SDPA's flash kernel on contiguous K/V (no paging, the floor)."""
    import torch.nn.functional as F

    from servescope.kernels.triton.prefill import paged_prefill
    from servescope.model.attention.reference import TorchAttentionBackend

    _prefill_check(rec, dev, dry)
    if dry:
        return
    g = torch.Generator(device="cpu").manual_seed(1)
    h, hkv, d, dt = 32, 8, 128, torch.bfloat16
    cases = {"prompt2048": [(2048, 2048)], "8x512": [(512, 512)] * 8, "chunk512_ctx4096": [(512, 4096)],
             "4x_chunk1024_ctx3072": [(1024, 3072)] * 4,
             "prompt2048_window512_softcap_sinks": [(2048, 2048)]}
    for name, seqs in cases.items():
        meta, q, k, v, kc, vc = _prefill_step(seqs, 16, hkv, h, d, dt, dt, dev, g)
        mods = dict(window=512, softcap=50.0, sinks=torch.zeros(h, device=dev)) if "window" in name else {}
        window = mods.get("window", 0)
        # score pairs the queries see (each query its own position and those before, within a window)
        pairs = sum(min(c - ql + i + 1, window or c) for ql, c in seqs for i in range(ql))
        flops = 4 * h * d * pairs  # q.k and p.v, 2 flops per multiply-add

        def run(warps=4, tiles=None):
            return paged_prefill(q, kc, vc, meta.block_tables, meta.context_lens, meta.query_start_loc, d ** -0.5,
                                 max_query_len=meta.max_query_len, num_warps=warps, tiles=tiles, **mods)

        secs = timed(run, dev, 10)
        ref = timed(lambda: TorchAttentionBackend().forward(q, k, v, kc, vc, meta, d ** -0.5, **mods), dev, 5)
        note = f"{secs * 1e6:.0f} us; torch reference {ref * 1e6:.0f} us ({ref / secs:.2f}x)"
        if all(ql == c for ql, c in seqs) and not mods:
            qs = [q[i * seqs[0][0]:(i + 1) * seqs[0][0]].transpose(0, 1)[None] for i in range(len(seqs))]
            ks = [k[i * seqs[0][0]:(i + 1) * seqs[0][0]].transpose(0, 1)[None] for i in range(len(seqs))]
            qb, kb = torch.cat(qs), torch.cat(ks)  # [B, H, L, D], [B, Hkv, L, D]
            flash = timed(lambda: F.scaled_dot_product_attention(qb, kb, kb, is_causal=True, enable_gqa=True), dev, 10)
            note += f"; SDPA causal, contiguous {flash * 1e6:.0f} us ({flash / secs:.2f}x)"
        rec(f"prefill_{name}", flops / secs / 1e12, "TFLOP/s", note)
        if name == "prompt2048":  # tile and warp variants of the first case, for the next tuning pass
            for warps, tiles in ((8, None), (4, (32, 64)), (8, (32, 64)), (4, (16, 32))):
                t = timed(lambda: run(warps, tiles), dev, 10)
                rec(f"prefill_{name}_w{warps}_{'x'.join(map(str, tiles or ('default',)))}", flops / t / 1e12,
                    "TFLOP/s", f"{t * 1e6:.0f} us")
        kc = vc = None  # frees the caches before the next case's (not del: the closures hold them)


def section_hardware(rec, dev, dry):
    n = (2 << 30) if not dry else (64 << 20)  # bytes per buffer
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    secs = timed(lambda: y.copy_(x), dev, 10 if not dry else 3)
    bw = 2 * n / secs / 1e9
    STATE["copy_gbs"] = bw
    rec("copy_bandwidth", bw, "GB/s", f"{n >> 20} MiB device-to-device, read + write")
    x = y = None  # frees the buffers before the matmul's (not del: the lambda closes over them)
    m = 8192 if not dry else 512
    dt = torch.bfloat16
    a = torch.randn(m, m, device=dev, dtype=dt)
    b = torch.randn(m, m, device=dev, dtype=dt)
    secs = timed(lambda: a @ b, dev, 10 if not dry else 2)
    rec("matmul_bf16", 2 * m ** 3 / secs / 1e12, "TFLOP/s", f"{m}^3")


def section_vs_hf(rec, dev, dry, spec: str, dtype: str, graph_sizes, need_equal: bool, lp_tol: float,
                  n_prompts: int, max_tokens: int, backend: str):
    """Our engine vs transformers on the same random weights; CUDA-graph vs eager decode."""
    llm = LLM(model=spec, dtype=dtype, device=dev.type, attention_backend=backend, max_num_seqs=8,
              max_num_batched_tokens=512, max_model_len=512, kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=False, cuda_graph_batch_sizes=tuple(graph_sizes), seed=1)
    eng = llm.engine
    cfg = eng.model_config
    graphs = eng.executor.graphs
    rec("engine", f"{eng.runner.backend.name}, graphs {graphs.batch_sizes if graphs else None}", "",
        f"{cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, {dtype}")
    prompts = random_prompts(n_prompts, 5, 60, cfg.vocab_size, seed=3)
    toks, lps, _ = ours_generate(llm, prompts, max_tokens, logprobs=True)
    hf = hf_from_ours(eng.model, cfg, dev)
    hf_toks, hf_lps = [], []
    for p in prompts:  # one at a time: no padding in the oracle
        t, lp, _ = hf_generate(hf, [p], max_tokens, dev, logits=True)
        hf_toks += t
        hf_lps += lp
    compare_runs(rec, "vs_transformers", toks, lps, hf_toks, hf_lps, lp_tol, need_equal)
    if graphs is not None:
        eng.executor.graphs = None
        try:
            e_toks, e_lps, _ = ours_generate(llm, prompts, max_tokens, logprobs=True)
        finally:
            eng.executor.graphs = graphs
        compare_runs(rec, "graph_vs_eager", toks, lps, e_toks, e_lps, 1e-3 if dtype == "float32" else 5e-2, True)
    del hf, llm, eng


def weights_read_per_decode_step(model) -> int:
    """Bytes of weights a decode step reads: everything but the input embedding table (only B rows
    of it are read), unless it doubles as the lm_head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head.weight is not model.model.embed_tokens.weight:  # untied: the table is not read whole
        e = model.model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


def decode_steps(eng, since: int, batch: int | None = None) -> list:
    recs = list(eng.step_records)[since:]
    return [r for r in recs if r.phase == "decode" and (batch is None or r.num_decode_seqs == batch)]


def section_8b_load(rec, dev, dry, spec, sizes):
    t = time.perf_counter()
    kw = dict(model=spec, dtype="bfloat16" if not dry else "float32", device=dev.type,
              max_num_seqs=sizes["max_seqs"], max_num_batched_tokens=sizes["batched_tokens"],
              max_model_len=sizes["max_len"], kv_cache_memory_bytes=sizes["kv_bytes"], seed=0)
    try:
        llm = LLM(attention_backend="triton" if not dry else "torch", **kw)
    except Exception as e:  # keep the speed table: fall back to the torch backend (no graphs)
        traceback.print_exc()
        rec("triton_engine_ok", False, "", f"{type(e).__name__}: {e}; numbers below use the torch backend")
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(attention_backend="torch", **kw)
    STATE["llm"] = llm
    eng = llm.engine
    g = eng.executor.graphs
    rec("load_seconds", time.perf_counter() - t, "s",
        f"weights {eng.weight_bytes / 1e9:.2f} GB, graphs captured in "
        f"{g.capture_seconds:.1f} s" if g else "no CUDA graphs")
    # warm up: compile kernels for prefill and mixed steps
    ours_generate(llm, random_prompts(2, 16, 40, eng.model_config.vocab_size, 9), 4)


def section_8b_batch1(rec, dev, dry, sizes):
    llm = STATE["llm"]
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompt = random_prompts(1, sizes["b1_prompt"], sizes["b1_prompt"], vocab, 11)
    since = len(eng.step_records)
    toks, _, secs = ours_generate(llm, prompt, sizes["b1_out"])
    steps = decode_steps(eng, since, 1)
    step = statistics.median(r.wall_seconds for r in steps)
    ctx = statistics.median(sum(r.context_lens) for r in steps)
    wbytes = weights_read_per_decode_step(eng.model)
    kv = eng.kv_bytes_per_token * ctx
    gbs = (wbytes + kv) / step / 1e9
    rec("b1_decode_tokens_per_s", 1.0 / step, "tok/s", f"median of {len(steps)} decode steps, {step * 1e3:.2f} ms/step")
    rec("b1_decode_GBps", gbs, "GB/s", f"weights {wbytes / 1e9:.2f} GB + KV {kv / 1e6:.1f} MB per step")
    if STATE.get("copy_gbs"):
        rec("b1_decode_pct_of_copy_bw", 100.0 * gbs / STATE["copy_gbs"], "%")
    rec("b1_generate_tokens_per_s", len(toks[0]) / secs, "tok/s", f"end to end incl. prefill of {len(prompt[0])}")
    STATE["b1_prompt"], STATE["b1_secs"], STATE["b1_step_s"] = prompt, secs, step
    STATE["b1_bytes"] = wbytes + kv


def _kernel_family(name: str) -> str:
    """A short family for a GPU kernel name: matmul (cuBLAS/nvjet/cutlass), one of our Triton
    kernels (by its function name), copy/fill, or the first word of anything else."""
    low = name.lower()
    if any(k in low for k in ("gemv", "gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "splitk")):
        return "matmul"
    if "memcpy" in low or "memset" in low or "fill" in low or "copy" in low:
        return "copy/fill"
    if name.startswith("_"):  # our Triton kernels are private functions: _paged_decode..., _rms_norm...
        return name.split("(")[0][:40]
    return name.split("<")[0].split("(")[0].strip()[:40]


def section_8b_b1_anatomy(rec, dev, dry, sizes):
    """Where one batch-1 decode step of the 8B model spends its time, measured piece by piece:
    the step's wall time (engine records), the GPU time of the captured layers (events around one
    graph replay), the lm_head + sampling, and what is left (host work with the GPU idle); then the
    same weights read by the matmuls alone, back to back in one CUDA graph (the ceiling cuBLAS's
    GEMV gives), and a per-kernel-family table of one replay (torch.profiler)."""
    from servescope.kernels.triton import gemv as triton_gemv

    llm = STATE["llm"]
    eng = llm.engine
    model = eng.model
    wall = STATE.get("b1_step_s")
    g = eng.executor.graphs
    hidden = torch.randn(1, eng.model_config.hidden_size, device=dev, dtype=model.lm_head.weight.dtype)
    logit_s = timed(lambda: model.compute_logits(hidden).argmax(-1), dev, 20 if not dry else 2)
    rec("lm_head_and_argmax_ms", logit_s * 1e3, "ms", "logits [1, V] in float32 + argmax")
    layers_s = None
    if g is not None and 1 in g.graphs:
        g.slot_mapping[:1].fill_(-1)  # replays below must not write any KV slot
        layers_s = timed(lambda: g.graphs[1].replay(), dev, 50)
        rec("graph_replay_gpu_ms", layers_s * 1e3, "ms", "embedding + all layers + final norm, batch 1")
    # every projection of a step (not the lm_head), each its own weight, back to back
    # the decoder's projections as the engine calls them (nn.Linear here; CpuLinear in a CPU dry run)
    linears = [m for _, _, m in triton_gemv.decoder_projections(model)]
    wbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    xs = {m.weight.shape[1]: torch.randn(1, m.weight.shape[1], device=dev, dtype=m.weight.dtype) for m in linears}

    def all_gemvs():
        for m in linears:
            m(xs[m.weight.shape[1]])

    if dev.type == "cuda":
        all_gemvs()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_gemvs()
        gemv_s = timed(graph.replay, dev, 20)
    else:
        gemv_s = timed(all_gemvs, dev, 2)
    gbs = wbytes / gemv_s / 1e9
    rec("gemvs_only_ms", gemv_s * 1e3, "ms", f"{len(linears)} projections, {wbytes / 1e9:.2f} GB"
        + (", one CUDA graph" if dev.type == "cuda" else ""))
    rec("gemvs_only_GBps", gbs, "GB/s")
    if STATE.get("copy_gbs"):
        rec("gemvs_only_pct_of_copy_bw", 100.0 * gbs / STATE["copy_gbs"], "%",
            "the ceiling of batch-1 decode with these matmul kernels and nothing else")
    if wall and layers_s:
        rec("step_wall_ms", wall * 1e3, "ms", "median engine step (section 8b_batch1)")
        rec("outside_gpu_ms", (wall - layers_s - logit_s) * 1e3, "ms",
            "wall - replay - lm_head/argmax: host work (schedule, inputs, sampling, bookkeeping) with the GPU idle")
        rec("non_matmul_in_graph_ms", (layers_s - gemv_s) * 1e3, "ms",
            "replay - matmuls alone: norms, rotary, KV store, attention, activation, launch gaps")
    if dev.type != "cuda" or g is None or 1 not in g.graphs:
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    reps = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.graphs[1].replay()
        torch.cuda.synchronize()
    fam: dict = {}
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        f = _kernel_family(e.key)
        t, n = fam.get(f, (0.0, 0))
        fam[f] = (t + e.self_device_time_total, n + e.count)
    total = sum(t for t, _ in fam.values())
    rec("profiled_kernel_us_per_step", total / reps, "us",
        f"sum of kernel times in one replay; replay by events {layers_s * 1e6:.0f} us" if total else
        "the profiler saw no kernel inside the graph replay")
    for f, (t, n) in sorted(fam.items(), key=lambda kv: -kv[1][0])[:12]:
        rec(f"kernels[{f}]", t / reps, "us", f"{n / reps:.0f} launches per step")


def _gemv_config_sweep(rec, model, dev, dry) -> None:
    """The Triton GEMV's block configurations at M = 1 on each decoder shape, over the model's own
    matrices of that shape: the best one and the default's GB/s (to choose the defaults)."""
    from servescope.kernels.triton import gemv as triton_gemv

    configs = [(1, 1024, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 4), (8, 256, 4),
               (16, 256, 4), (16, 512, 8)] if not dry else [(16, 64, 4)]  # the interpreter is slow
    shapes: dict = {}
    for _, _, mod in triton_gemv.decoder_projections(model):
        shapes.setdefault(tuple(mod.weight.shape), []).append(mod.weight)
    for (n, k), ws in shapes.items():
        x = torch.randn(1, k, device=dev, dtype=ws[0].dtype)
        nbytes = n * k * ws[0].element_size()
        timings = {}
        for bn, bk, nw in [(None, None, None)] + configs:
            cfg = None if bn is None else {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw}
            try:
                timings[(bn, bk, nw)] = triton_gemv.seconds_per_call(
                    lambda: [triton_gemv.gemv(x, w, config=cfg) for w in ws], 3 if not dry else 1,
                    5 if not dry else 1) / len(ws)
            except SectionTimeout:
                raise
            except Exception as e:  # one configuration that does not compile must not hide the others
                print(f"config {(bn, bk, nw)} on {n}x{k}: {type(e).__name__}: {e}")
        if not timings:
            continue
        best = min(timings, key=timings.get)
        default = timings.get((None, None, None))
        rec(f"gemv_{n}x{k}_m1_best_config_GBps", nbytes / timings[best] / 1e9, "GB/s",
            f"BLOCK_N, BLOCK_K, warps = {best}; default config "
            + (f"{nbytes / default / 1e9:.0f} GB/s" if default else "failed"))


def section_8b_gpu_linear(rec, dev, dry, sizes):
    """The Triton GEMV (model/triton_gemv.py) against cuBLAS for the decode matmuls of the 8B model:
    per weight shape at M = 1 and 4 (timed by select("auto") on the model's own matrices), then
    batch-1 decode under cuBLAS, auto and triton (graphs re-captured each time), and each run's
    greedy tokens and logprobs against cuBLAS's. The engine is left on cuBLAS for what follows."""
    llm = STATE["llm"]
    eng = llm.engine
    model = eng.model
    prompt = STATE["b1_prompt"]
    n_check = 32 if not dry else 8
    modes = ("cublas", "auto", "triton")
    _gemv_config_sweep(rec, model, dev, dry)
    base = None
    try:
        for mode in modes:
            choice = eng.set_gpu_linear(mode)  # graphs re-captured with the chosen kernels
            if mode == "auto":
                for (n, k, m), v in sorted(choice.items()):
                    if m in (1, 4):
                        nbytes = n * k * model.lm_head.weight.element_size()
                        rec(f"gemv_{n}x{k}_m{m}_GBps", nbytes / v["triton_s"] / 1e9 if v["triton_s"] else 0.0,
                            "GB/s", f"Triton; cuBLAS {nbytes / v['cublas_s'] / 1e9:.0f} GB/s -> {v['use']}")
                rec("auto_triton_cases", sum(v["use"] == "triton" for v in choice.values()), "",
                    f"of {len(choice)} (shape, M) cases")
            toks, lps, _ = ours_generate(llm, prompt, n_check, logprobs=True)
            if base is None:
                base = (toks, lps)
            else:
                same = 0
                while same < len(toks[0]) and toks[0][same] == base[0][0][same]:
                    same += 1
                diff = max((abs(a - b) for a, b in zip(lps[0][:same], base[1][0][:same])), default=0.0)
                rec(f"{mode}_vs_cublas_tokens_equal", f"{same}/{len(toks[0])}", "tokens",
                    "greedy, random bf16 weights: near-ties may flip")
                rec(f"{mode}_vs_cublas_max_logprob_diff", diff, "nats", "over the equal prefix")
            since = len(eng.step_records)
            ours_generate(llm, prompt, sizes["b1_out"])
            step = statistics.median(r.wall_seconds for r in decode_steps(eng, since, 1))
            rec(f"{mode}_b1_decode_tokens_per_s", 1.0 / step, "tok/s", f"{step * 1e3:.2f} ms/step")
            if STATE.get("copy_gbs") and STATE.get("b1_bytes"):
                rec(f"{mode}_b1_decode_pct_of_copy_bw", 100.0 * STATE["b1_bytes"] / step / 1e9 / STATE["copy_gbs"], "%")
    finally:
        eng.set_gpu_linear("cublas")


def section_8b_throughput(rec, dev, dry, sizes, batch: int):
    llm = STATE["llm"]
    eng = llm.engine
    prompts = random_prompts(batch, sizes["tp_lo"], sizes["tp_hi"], eng.model_config.vocab_size, 100 + batch)
    since = len(eng.step_records)
    toks, _, secs = ours_generate(llm, prompts, sizes["tp_out"])
    n_out = sum(len(t) for t in toks)
    n_in = sum(len(p) for p in prompts)
    rec(f"b{batch}_output_tokens_per_s", n_out / secs, "tok/s",
        f"{batch} x ({n_in // batch} avg prompt, {sizes['tp_out']} out) in {secs:.1f} s")
    rec(f"b{batch}_total_tokens_per_s", (n_in + n_out) / secs, "tok/s")
    full = decode_steps(eng, since, batch)
    if full:
        step = statistics.median(r.wall_seconds for r in full)
        rec(f"b{batch}_decode_step_ms", step * 1e3, "ms", f"{batch / step:.0f} tok/s while all {batch} decode")
    STATE[f"b{batch}_prompts"] = prompts
    STATE[f"b{batch}_secs"] = secs


def section_8b_vs_hf(rec, dev, dry, sizes):
    llm = STATE["llm"]
    eng = llm.engine
    hf = hf_from_ours(eng.model, eng.model_config, dev)
    hf_generate(hf, [[5] * 8], 2, dev)  # warm-up
    # batch 1: the same prompt, the same number of new tokens
    prompt = STATE.get("b1_prompt") or random_prompts(1, sizes["b1_prompt"], sizes["b1_prompt"],
                                                      eng.model_config.vocab_size, 11)
    n = sizes["hf_out"]
    _, _, ours = ours_generate(llm, prompt, n)
    _, _, theirs = hf_generate(hf, prompt, n, dev)
    rec("hf_b1_tokens_per_s", n / theirs, "tok/s", f"transformers generate, {n} new tokens")
    rec("ours_b1_tokens_per_s", n / ours, "tok/s", "same workload, end to end")
    rec("speedup_b1_vs_transformers", theirs / ours, "x")
    hb = sizes["hf_batch"]
    prompts = random_prompts(hb, sizes["tp_lo"], sizes["tp_hi"], eng.model_config.vocab_size, 7)
    _, _, ours = ours_generate(llm, prompts, n)
    _, _, theirs = hf_generate(hf, prompts, n, dev)
    rec(f"hf_b{hb}_tokens_per_s", hb * n / theirs, "tok/s", "transformers generate, left-padded batch")
    rec(f"ours_b{hb}_tokens_per_s", hb * n / ours, "tok/s", "same workload, end to end")
    rec(f"speedup_b{hb}_vs_transformers", theirs / ours, "x")
    del hf


# ------------------------------------------------------------------------------------------ main


def tiny_config(tied: bool = False) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": tied}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens per measurement")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny models on the CPU (smoke test of this script)")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds (of CPU time in a dry run); later sections are skipped past it")
    ap.add_argument("--only", default=None, metavar="S1,S2",
                    help="run only these sections (names as in the table; 8b_* also run what they need)")
    args = ap.parse_args(argv)
    dry, quick = args.dry_run_cpu, args.quick or args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run-cpu for a smoke test", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if not dry else "cpu")
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="servescope_gpu_")
    from servescope.analysis.presets import preset_hf_dict

    if dry:
        tiny = "random:" + write_config(tiny_config(), tmp, "tiny")
        smol_spec = "random:" + write_config(tiny_config(tied=True), tmp, "tiny-tied")  # SmolLM2 ties embeddings
        llama_shape_spec = big_spec = tiny
    else:
        smol_spec = "random:smollm2-135m"
        short = dict(preset_hf_dict("llama-3-8b"), num_hidden_layers=2)
        short.pop("_source", None)
        llama_shape_spec = "random:" + write_config(short, tmp, "llama-3-8b-2layers")
        big_spec = "random:llama-3-8b"
    sizes = {
        "max_seqs": 256 if not dry else 8, "batched_tokens": 8192 if not dry else 512,
        "max_len": 1024 if not dry else 256, "kv_bytes": (40 << 30) if not dry else (64 << 20),
        "b1_prompt": 128 if not dry else 16, "b1_out": 128 if quick else 256,
        "tp_lo": 128 if not dry else 8, "tp_hi": 512 if not dry else 32, "tp_out": 128 if quick else 256,
        "hf_out": 64 if quick else 128, "hf_batch": 64 if not dry else 4,
    }
    if dry:
        sizes.update(b1_out=8, tp_out=8, hf_out=8)
    batches = (64, 256) if not dry else (4, 8)
    graph_sizes = (1, 2, 4, 8)
    backend = "triton" if not dry else "torch"
    budget = args.budget
    only = [x for x in (args.only or "").split(",") if x]
    # the 8B sections need the engine (8b_load) and the copy bandwidth (hardware); these three the
    # batch-1 prompt and step time of 8b_batch1
    needed = set(only) | ({"hardware", "8b_load"} if any(o.startswith("8b") for o in only) else set())
    if needed & {"8b_b1_anatomy", "8b_gpu_linear", "8b_vs_transformers"}:
        needed.add("8b_batch1")

    def sec(name, fn, timeout):
        if only and name not in needed:
            return
        run_section(name, fn, timeout, budget, cpu_clock=dry)

    sec("env", section_env, 30)
    sec("kernels", lambda r: section_kernels(r, dev, dry), 120)
    sec("quant_kernels", lambda r: section_quant_kernels(r, dev, dry), 60)
    sec("moe_kernels", lambda r: section_moe_kernels(r, dev, dry), 90)
    sec("prefill", lambda r: section_prefill(r, dev, dry), 120)
    sec("hardware", lambda r: section_hardware(r, dev, dry), 60)
    sec("vs_hf_smollm2_fp32", lambda r: section_vs_hf(
        r, dev, dry, smol_spec, "float32", graph_sizes, True, 1e-3, 4, 24 if quick else 48, backend), 120)
    sec("vs_hf_llama3shape_fp32", lambda r: section_vs_hf(
        r, dev, dry, llama_shape_spec, "float32", graph_sizes, True, 1e-3, 3, 16 if quick else 32, backend), 120)
    sec("vs_hf_llama3shape_bf16", lambda r: section_vs_hf(
        r, dev, dry, llama_shape_spec, "bfloat16", graph_sizes, False, 0.25, 3, 16 if quick else 32, backend), 120)
    sec("8b_load", lambda r: section_8b_load(r, dev, dry, big_spec, sizes), 180)
    if "llm" in STATE:
        sec("8b_batch1", lambda r: section_8b_batch1(r, dev, dry, sizes), 60)
        sec("8b_b1_anatomy", lambda r: section_8b_b1_anatomy(r, dev, dry, sizes), 90)
        sec("8b_gpu_linear", lambda r: section_8b_gpu_linear(r, dev, dry, sizes), 180)
        for b in batches:
            sec(f"8b_batch{b}", lambda r, b=b: section_8b_throughput(r, dev, dry, sizes, b), 120)
        sec("8b_vs_transformers", lambda r: section_8b_vs_hf(r, dev, dry, sizes), 150)
    STATE.clear()

    print_table()
    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, "gpu_results.json")
        with open(path, "w") as f:
            json.dump({"mode": "dry-run-cpu" if dry else ("quick" if quick else "full"),
                       "total_seconds": round(time.perf_counter() - T_START, 1),
                       "sections": SECTIONS, "rows": ROWS}, f, indent=1)
        print(f"wrote {path}")
    return 0 if all(s["status"] == "ok" for s in SECTIONS) else 1


def print_table() -> None:
    w = max([len(r["section"]) for r in ROWS] + [7])
    m = max([len(r["metric"]) for r in ROWS] + [6])
    print()
    print(f"{'section':<{w}}  {'metric':<{m}}  {'value':>14}  unit    note")
    for r in ROWS:
        v = r["value"]
        vs = f"{v:,.4g}" if isinstance(v, float) else str(v)
        print(f"{r['section']:<{w}}  {r['metric']:<{m}}  {vs:>14}  {r['unit']:<6}  {r['note']}")
    print()
    for s in SECTIONS:
        print(f"{s['section']:<{w}}  {s['status']:<8} {s['seconds']:6.1f}s  {s['error']}")
    print(f"total {time.perf_counter() - T_START:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
