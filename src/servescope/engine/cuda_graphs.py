"""CUDA graphs for decode steps: capture the forward once per batch size, replay it each step.

Shape legend: B sequences in the step (one token each), Bg the captured size >= B,
Bmax the largest captured size, M max blocks per sequence, Dm model width.

A decode step of a small model, or of any model at small batch, launches hundreds of small
kernels; replaying a captured graph removes the per-kernel launch cost from the step.

What is captured: embedding -> layers (attention through the backend) -> final norm, on
static input buffers. The lm_head is not captured: the ModelRunner computes logits from the
returned hidden rows. Invariants of the static buffers:
  - rows [B, Bg) of a replay are padding: slot -1 (the KV store skips them) and context
    length 0 (the decode kernel outputs zeros), so they never touch the cache;
  - the decode kernel reads block_tables[b, :ceil(context_lens[b] / S)] only, so stale table
    entries beyond a row's blocks are never read;
  - the AttentionMetadata of a graph has host values fixed at capture (max_context_len is
    the table's capacity), which the backend uses only to size its launch grids.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from servescope.model.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    """Captured decode forwards for a set of batch sizes, sharing one memory pool."""

    def __init__(self, model: torch.nn.Module, runner, batch_sizes, max_blocks_per_seq: int):
        if not getattr(runner.backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {runner.backend.name!r} cannot run under CUDA graphs "
                             f"(it must skip slot -1 and accept context length 0); use 'triton'")
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if model.config.mla:  # its store and expanded prefill are torch ops the graph's padded rows would break
            raise ValueError("latent attention (DeepSeek) is not captured in CUDA graphs yet; run without them")
        sizes = sorted({int(b) for b in batch_sizes if int(b) > 0})
        if not sizes:
            raise ValueError("no batch size to capture")
        self.model = model
        self.runner = runner
        self.batch_sizes = sizes
        self.max_batch = sizes[-1]
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.block_size = runner.block_size
        self.capture_seconds: Optional[float] = None
        dev = runner.device
        bmax, m = self.max_batch, self.max_blocks_per_seq
        # static inputs, sliced [:Bg] by the graph of size Bg
        self.input_ids = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((bmax,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((bmax, m), dtype=torch.int32, device=dev)  # [Bmax, M]
        self.context_lens = torch.zeros(bmax, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32, device=dev)
        self.graphs: dict = {}  # Bg -> torch.cuda.CUDAGraph
        self.outputs: dict = {}  # Bg -> hidden [Bg, Dm] (memory owned by the shared pool)
        self.pool = None

    def _meta(self, bg: int) -> AttentionMetadata:
        cap = self.max_blocks_per_seq * self.block_size
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bg],
            block_tables=self.block_tables[:bg],
            context_lens=self.context_lens[:bg],
            query_start_loc=self.query_start_loc[:bg + 1],
            query_lens_cpu=[1] * bg,
            context_lens_cpu=[cap] * bg,  # host bound only; the kernels read context_lens
            max_query_len=1,
            max_context_len=cap,
            num_decode_seqs=bg,
        )

    def _forward(self, bg: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bg], self.positions[:bg], self.runner.kv_caches, meta,
                          self.runner.backend)  # [Bg, Dm]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every batch size, largest first (later, smaller graphs reuse the pool's memory).
        Returns the capture time in seconds."""
        t0 = time.perf_counter()
        # while capturing every row is padding: no cache writes, no cache reads
        self.slot_mapping.fill_(-1)
        self.context_lens.zero_()
        self.pool = torch.cuda.graph_pool_handle()
        for bg in reversed(self.batch_sizes):
            meta = self._meta(bg)
            # warm up on a side stream: compiles the Triton kernels and settles allocator state
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bg, meta)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(bg, meta)
            self.graphs[bg] = graph
            self.outputs[bg] = out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2f s", self.batch_sizes,
                    self.capture_seconds)
        return self.capture_seconds

    def _graph_size(self, b: int) -> Optional[int]:
        for bg in self.batch_sizes:
            if bg >= b and bg in self.graphs:
                return bg
        return None

    def can_run(self, batch) -> bool:
        meta = batch.meta
        b = meta.num_seqs
        # a graph holds one set of tables for all layers: a step with a table per group of layers runs eagerly
        return (meta.is_decode_only and batch.num_tokens == b and not meta.window_groups
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq
                and self._graph_size(b) is not None)

    def run(self, batch) -> torch.Tensor:
        """Replay the smallest captured graph >= B on the batch; returns hidden [B, Dm] (a view of
        the graph's output buffer, valid until the next replay)."""
        meta = batch.meta
        b = meta.num_seqs
        bg = self._graph_size(b)
        m = meta.block_tables.shape[1]
        # device-to-device copies into the static buffers, no host sync
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:b, :m].copy_(meta.block_tables, non_blocking=True)
        if bg > b:  # padding rows: no write, no read
            self.slot_mapping[b:bg].fill_(-1)
            self.context_lens[b:bg].zero_()
        self.graphs[bg].replay()
        return self.outputs[bg][:b]
