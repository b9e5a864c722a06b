"""Test helpers: run a model over a whole token sequence through the paged-cache path."""

from types import SimpleNamespace

import torch

from servescope.engine.model_runner import ModelRunner


def paged_logits(engine, ids, chunk=None, decode_from=None):
    """Logits [len(ids), V] of every position, computed by our model through a private paged cache.

    chunk: prefill in chunks of this many tokens; decode_from: positions >= this are fed one token at
    a time (decode steps reading the cache)."""
    cfg = engine.model_config
    bs = engine.cache_config.block_size
    nblocks = -(-len(ids) // bs)
    runner = ModelRunner(engine.executor.fork(), cfg, engine.runner.backend, nblocks, bs, engine.kv_dtype,
                         engine.device)
    req = SimpleNamespace(all_token_ids=list(ids))
    blocks = list(range(nblocks))
    n = len(ids)
    decode_from = n if decode_from is None else decode_from
    spans, p = [], 0
    while p < decode_from:
        q = min(decode_from, p + (chunk or decode_from))
        spans.append((p, q - p))
        p = q
    spans += [(i, 1) for i in range(decode_from, n)]
    out = []
    with torch.inference_mode():
        for start, num in spans:
            seq = SimpleNamespace(request=req, num_computed_tokens=start, num_new_tokens=num,
                                  block_ids=blocks, spec_token_ids=())
            batch = runner.prepare([seq])
            hidden = runner.executor.forward(batch, runner.kv_caches, runner.backend)
            out.append(runner.executor.compute_logits(hidden))
    return torch.cat(out)
