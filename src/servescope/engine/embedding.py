"""Embeddings: one prefill of each input through the model, pooled (last token or mean) and
L2-normalised, as OpenAI's /v1/embeddings returns them.

Each input runs on a runner of its own with a KV cache just big enough for it (the engine's cache
and its requests are not touched), on the engine thread, between steps.
Shapes: T tokens of the input, Dm hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servescope.engine.model_runner import ModelRunner
from servescope.errors import InvalidParameterError

POOLINGS = ("last", "mean")


@dataclass
class _Request:
    all_token_ids: list


@dataclass
class _Sequence:
    """The one scheduled sequence of an embedding pass (the fields ModelRunner.prepare reads)."""

    request: _Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list
    spec_token_ids: tuple = ()  # an embedding pass never verifies drafts


@torch.inference_mode()
def embed(engine, inputs: list, pooling: str = "last", normalize: bool = True) -> list:
    """One float32 vector [Dm] per token-id list, after the model's final norm."""
    if pooling not in POOLINGS:
        raise InvalidParameterError("pooling", f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    bs = engine.cache_config.block_size
    out = []
    for ids in inputs:
        if not ids or len(ids) > engine.max_model_len:
            raise InvalidParameterError("input", f"each input needs 1..{engine.max_model_len} tokens, got {len(ids)}")
        nblocks = -(-len(ids) // bs)
        runner = ModelRunner(engine.executor.fork(), engine.model_config, engine.runner.backend, nblocks, bs,
                             engine.kv_dtype, engine.device)
        seq = _Sequence(_Request(list(ids)), 0, len(ids), list(range(nblocks)))
        hidden = runner.executor.forward(runner.prepare([seq]), runner.kv_caches, runner.backend)  # [T, Dm]
        vec = (hidden[-1] if pooling == "last" else hidden.mean(dim=0)).float()  # [Dm]
        if normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        out.append(vec.cpu().tolist())
    return out
