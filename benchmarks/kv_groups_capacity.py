"""Tokens of context a fixed KV memory holds with one block table for all layers and with a table per group of
layers of one window (kvcache/hybrid.py), for Gemma 3 and gpt-oss shapes. Deterministic: the engine's own KV
managers on integers, the pools split by the planner (analysis/kv_layout.group_blocks) as the engine splits them.

For each shape and context: sequences of that many tokens are admitted chunk by chunk (max_num_batched_tokens a
step, as the scheduler's chunked prefill does) and take their first decode step, until one no longer fits (or
max_num_seqs run); reported: the sequences held, the tokens they hold, and the longest single sequence.

    PYTHONPATH=src python benchmarks/kv_groups_capacity.py [--budget-gib 16] [--max-num-seqs 256] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from servescope.analysis.kv_layout import group_blocks
from servescope.config import CacheConfig
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import KVCacheManager

S = 16
# name: (layers per window (0: full attention), KV bytes per token and layer: 2 x KV heads x head_dim x 2 (bf16))
SHAPES = {
    "gemma-3-1b": ({0: 4, 512: 22}, 2 * 1 * 256 * 2),
    "gemma-3-27b": ({0: 10, 1024: 52}, 2 * 16 * 128 * 2),
    "gpt-oss-20b": ({0: 12, 128: 12}, 2 * 8 * 64 * 2),
    "gpt-oss-120b": ({0: 18, 128: 18}, 2 * 8 * 64 * 2),
}


def sequences_held(km, ctx: int, chunk: int, limit: int) -> int:
    held = 0
    while held < limit:
        seq = SimpleNamespace(request_id=str(held), all_token_ids=list(range(held, held + ctx)), num_computed_tokens=0,
                              num_tokens=ctx)
        while seq.num_computed_tokens < ctx:
            n = min(chunk, ctx - seq.num_computed_tokens)
            if not km.allocate_slots(seq, n):
                return held
            seq.num_computed_tokens += n
        seq.all_token_ids.append(0)  # its first decode step: a windowed group gives back what slid out
        seq.num_tokens += 1
        if not km.allocate_slots(seq, 1):
            return held
        seq.num_computed_tokens += 1
        held += 1
    return held


def measure(layers: dict, per_layer: int, budget: int, ctx: int, max_num_seqs: int, chunk: int) -> dict:
    blocks = budget // (per_layer * sum(layers.values()) * S)  # the uniform cache: N blocks of every layer
    cc = CacheConfig(block_size=S, num_blocks=blocks, enable_prefix_caching=False)
    one = KVCacheManager(cc)
    pools = group_blocks(layers, blocks, S, max_num_seqs, 1, chunk)
    per_group = HybridKVCacheManager(cc, pools, layers, chunk)
    before = sequences_held(one, ctx, chunk, max_num_seqs)
    after = sequences_held(per_group, ctx, chunk, max_num_seqs)
    used = sum(pools[w] * n for w, n in layers.items()) * S * per_layer
    return {"uniform_blocks": blocks, "pools": pools, "bytes_uniform": blocks * S * per_layer * sum(layers.values()),
            "bytes_per_group": used, "max_context_before": blocks * S, "max_context_after": per_group.num_blocks * S,
            "sequences_before": before, "sequences_after": after,
            "tokens_before": before * ctx, "tokens_after": after * ctx}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    budget = int(args.budget_gib * 2**30)
    out = {}
    print(f"KV budget {args.budget_gib} GiB, block {S}, max_num_seqs {args.max_num_seqs}, chunk {args.chunk}")
    print(f"{'shape':14} {'ctx':>6} {'seqs 1 table':>12} {'seqs/group':>10} {'tokens 1 table':>15} "
          f"{'tokens/group':>13} {'x':>6} {'longest 1 table':>16} {'longest/group':>14}")
    for name, (layers, per_layer) in SHAPES.items():
        for ctx in map(int, args.contexts.split(",")):
            r = measure(layers, per_layer, budget, ctx, args.max_num_seqs, args.chunk)
            out[f"{name}@{ctx}"] = r
            gain = r["tokens_after"] / r["tokens_before"] if r["tokens_before"] else float("inf")
            print(f"{name:14} {ctx:>6} {r['sequences_before']:>12} {r['sequences_after']:>10} "
                  f"{r['tokens_before']:>15} {r['tokens_after']:>13} {gain:>6.2f} {r['max_context_before']:>16} "
                  f"{r['max_context_after']:>14}")
            assert r["bytes_per_group"] <= r["bytes_uniform"]  # the same memory
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
