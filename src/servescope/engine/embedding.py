"""Embeddings: one prefill of each input through the model, pooled (last token or mean) and
L2-normalised, as OpenAI's /v1/embeddings returns them.

Each input runs on a runner of its own with a KV cache just big enough for it (the engine's cache
and its requests are not touched), on the engine thread, between steps, a chunk at a time
(EmbeddingJob), so that a long input does not hold the engine for its whole prefill.
Shapes: T tokens of the input, Dm hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


class EmbeddingJob:
    """One input's embedding, computed a chunk at a time (engine thread): `step(engine)` runs the next
    at most `chunk_tokens` tokens through the model over the job's own KV cache and returns the
    vector [Dm] once the last chunk ran (None before). Between two chunks the engine steps its
    requests, so a long input delays them by one chunk per step, as chunked prefill does."""

    def __init__(self, ids: list, pooling: str = "last", normalize: bool = True, chunk_tokens: int = 512):
        if pooling not in POOLINGS:
            raise InvalidParameterError("pooling", f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.ids, self.pooling, self.normalize = list(ids), pooling, normalize
        self.chunk_tokens = max(1, chunk_tokens)
        self.done_tokens = 0
        self._runner = None
        self._sum: Optional[torch.Tensor] = None  # mean pooling: the sum of the rows so far [Dm]

    @torch.inference_mode()
    def step(self, engine) -> Optional[list]:
        ids = self.ids
        if self._runner is None:
            if not ids or len(ids) > engine.max_model_len:
                raise InvalidParameterError("input", f"each input needs 1..{engine.max_model_len} tokens, "
                                                     f"got {len(ids)}")
            bs = engine.cache_config.block_size
            nblocks = -(-len(ids) // bs)
            self._runner = ModelRunner(engine.executor.fork(), engine.model_config, engine.runner.backend, nblocks,
                                       bs, engine.kv_dtype, engine.device)
            self._blocks = list(range(nblocks))
        runner = self._runner
        n = min(self.chunk_tokens, len(ids) - self.done_tokens)
        seq = _Sequence(_Request(ids), self.done_tokens, n, self._blocks)
        hidden = runner.executor.forward(runner.prepare([seq]), runner.kv_caches, runner.backend)  # [n, Dm]
        self.done_tokens += n
        if self.pooling == "mean":
            part = hidden.float().sum(dim=0)
            self._sum = part if self._sum is None else self._sum + part
        if self.done_tokens < len(ids):
            return None
        vec = hidden[-1].float() if self.pooling == "last" else self._sum / len(ids)  # [Dm]
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        self._runner = None  # its KV cache is freed now, not when the job is dropped
        return vec.cpu().tolist()


def embed(engine, inputs: list, pooling: str = "last", normalize: bool = True) -> list:
    """One float32 vector [Dm] per token-id list, after the model's final norm (all at once, on the
    calling thread; the server runs EmbeddingJobs chunk by chunk instead)."""
    out = []
    for ids in inputs:
        job = EmbeddingJob(ids, pooling, normalize, chunk_tokens=max(1, len(ids)))
        out.append(job.step(engine))
    return out
