"""float32 causal prefill attention: the tiled C++ kernel (`cpu_ops.prefill_attention`, csrc/prefill_f32.h)
against what the CPU backend ran before it, SDPA (its flash kernel for a fresh prompt; over the gathered
blocks with a mask for a chunk after cached tokens, as model/attention/reference.py does).

    python benchmarks/prefill_attention_f32.py [--shapes 32/8/64,24/8/128] [--points 16:0,64:0,512:0,256:768]
        [--threads 2] [--rounds 5] [--json FILE]
    python benchmarks/prefill_attention_f32.py --model FILE.gguf [--prompt-tokens 512,2048]

Shapes are query heads / KV heads / head dim (default: Llama-3.2-1B's and 3B's); points are prompt tokens :
tokens already cached. One layer's call per point, median of the rounds; prints both times, the ratio and the
kernel's largest difference from SDPA. With --model: the engine's own prefills of fresh prompts (prefix caching
off, three each after one warm-up), TTFT and the seconds spent in SDPA and the tiled kernel, timed where the
backend calls them. To compare trees, point PYTHONPATH (and TORCH_EXTENSIONS_DIR) at each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from servescope.kernels.cpu import ops as cpu_ops
from servescope.timing import median_seconds

BLOCK = 16


def _pairs(text: str, sep: str, n: int, what: str) -> list:
    try:
        out = [tuple(int(x) for x in item.split(sep)) for item in text.split(",")]
    except ValueError:
        raise SystemExit(f"{what}: integers separated by {sep!r}, got {text!r}") from None
    if any(len(p) != n or min(p) < 0 for p in out):
        raise SystemExit(f"{what}: {n} non-negative integers each, got {text!r}")
    return out


def one_point(h: int, hkv: int, d: int, t: int, cached: int, rounds: int) -> dict:
    ctx = t + cached
    nb = -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(t + ctx)
    kc, vc = torch.randn(nb + 2, BLOCK, hkv, d, generator=gen), torch.randn(nb + 2, BLOCK, hkv, d, generator=gen)
    table = (torch.randperm(nb + 2, generator=gen)[:nb]).int()  # scattered, as the allocator hands blocks out
    q = torch.randn(t, h, d, generator=gen)
    scale = d ** -0.5
    mask = None if not cached else torch.arange(ctx)[None, :] <= torch.arange(cached, ctx)[:, None]

    def sdpa():
        k = kc[table.long()].flatten(0, 1)[:ctx].transpose(0, 1)[None]
        v = vc[table.long()].flatten(0, 1)[:ctx].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)[0].transpose(0, 1)

    def kernel():
        return cpu_ops.prefill_attention(q, kc, vc, table, ctx, scale)

    diff = (kernel() - sdpa()).abs().max().item()
    s_sdpa, s_kernel = median_seconds(sdpa, rounds), median_seconds(kernel, rounds)
    flops = 4 * h * d * sum(cached + i + 1 for i in range(t))  # q.k and p.v over the keys each query sees
    return {"heads": h, "kv_heads": hkv, "head_dim": d, "tokens": t, "cached": cached, "sdpa_ms": 1e3 * s_sdpa,
            "kernel_ms": 1e3 * s_kernel, "ratio": s_sdpa / s_kernel, "kernel_gflops": flops / s_kernel / 1e9,
            "max_abs_diff": diff}


def engine_prefills(model: str, lengths: list, threads: int) -> list:
    """[{tokens, ttft_s per prefill, attention_s per prefill}] of the engine on `model` (float32 activations for a
    GGUF): the attention calls of the CPU backend timed by wrapping SDPA and the tiled kernel."""
    from servescope.bench.latency import run_engine_latency  # (the engine: only this mode loads it)
    from servescope.engine.llm import LLM  # (likewise)

    llm = LLM(model=model, quantization="gguf" if model.endswith(".gguf") else None, num_threads=threads,
              max_num_seqs=4, max_model_len=max(lengths) + 8, enable_prefix_caching=False)
    spent = [0.0]
    for mod, name in ((F, "scaled_dot_product_attention"), (cpu_ops, "prefill_attention")):
        real = getattr(mod, name)

        def timed(*a, _real=real, **kw):
            t = time.perf_counter()
            out = _real(*a, **kw)
            spent[0] += time.perf_counter() - t
            return out
        setattr(mod, name, timed)
    rows = []
    for n in lengths:
        run_engine_latency(llm, 1, n, 1, iters=1, measure_bandwidth=False)
        spent[0] = 0.0
        res = run_engine_latency(llm, 1, n, 1, iters=3, measure_bandwidth=False)
        ttfts = [r["ttft_s"] for r in res["iterations"]]
        rows.append({"tokens": n, "ttft_s": ttfts, "attention_s": spent[0] / len(ttfts)})
        print(f"{n:>6} tokens: TTFT median {statistics.median(ttfts):.3f} s of {[round(t, 3) for t in ttfts]}, "
              f"attention {spent[0] / len(ttfts):.3f} s a prefill")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="32/8/64,24/8/128")
    ap.add_argument("--points", default="16:0,32:0,64:0,256:0,512:0,2048:0,32:480,256:768,512:1536")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="time the engine's prefills on this model instead")
    ap.add_argument("--prompt-tokens", default="512,2048")
    args = ap.parse_args()
    if args.model:
        torch.set_num_threads(args.threads)
        rows = engine_prefills(args.model, [int(n) for n in args.prompt_tokens.split(",")], args.threads)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "model": args.model, "rows": rows}, f, indent=1)
        return
    shapes, points = _pairs(args.shapes, "/", 3, "--shapes"), _pairs(args.points, ":", 2, "--points")
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        raise SystemExit("the CPU kernels did not build on this machine (see the warning above)")
    rows = []
    print(f"float32 prefill attention, {args.threads} threads, one layer, median of {args.rounds} ({cpu_ops.isa()})")
    print(f"{'shape':>12} {'tokens':>7} {'cached':>7} {'SDPA ms':>9} {'kernel ms':>10} {'SDPA/kernel':>12} "
          f"{'GFLOP/s':>8} {'max diff':>9}")
    for h, hkv, d in shapes:
        if not cpu_ops.prefill_attention_supported(h // hkv, d, torch.float32) or h % hkv:
            raise SystemExit(f"no tiled kernel for {h} heads over {hkv} KV heads of dim {d}")
        for t, cached in points:
            r = one_point(h, hkv, d, t, cached, args.rounds)
            rows.append(r)
            print(f"{f'{h}/{hkv}/{d}':>12} {t:>7} {cached:>7} {r['sdpa_ms']:>9.2f} {r['kernel_ms']:>10.2f} "
                  f"{r['ratio']:>11.2f}x {r['kernel_gflops']:>8.0f} {r['max_abs_diff']:>9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "isa": cpu_ops.isa(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
