"""A pipeline step's micro-batches: the cuts rank 0 chooses, and each micro-batch's slice of the step.

Shape legend: T tokens in the step, B sequences, M max blocks per sequence, t / b a micro-batch's.

A micro-batch is the tokens [lo, hi) of the step's flat layout. A sequence cut in two becomes two
chunks of a chunked prefill: the first piece's context ends at its last token, the second attends over
the first's keys, which the same stage has stored one micro-batch earlier (stages run their
micro-batches in order, so every write of micro-batch i precedes every read of i + 1 at each layer:
the backend invariant, micro-batch by micro-batch). What would break it is a sequence that reads a
block a *later* sequence of the same step writes; rank 0 never cuts between two such sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from servescope.analysis.pipeline_schedule import cut_points
from servescope.model.attention.backend import AttentionMetadata


@dataclass
class MicroBatch:
    lo: int  # its tokens are [lo, hi) of the step's T
    hi: int
    input_ids: torch.Tensor  # [t]
    positions: torch.Tensor  # [t]
    meta: AttentionMetadata  # over its b sequences (pieces)

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo


def _token_starts(query_lens: list) -> list:
    out = [0]
    for q in query_lens:
        out.append(out[-1] + q)
    return out


def forbidden_spans(meta: AttentionMetadata, block_size: int) -> tuple:
    """Open token intervals (start of i, end of j) no cut may fall in, for each pair of sequences
    i < j where i reads a KV block that j writes in this step (a prefix hit on a block computed in
    the same step, or a verification's rows)."""
    qsl = _token_starts(meta.query_lens_cpu)
    spans = set()
    for group in (meta, *meta.window_groups.values()):  # a table per group of layers: each group's blocks
        tables = group.block_tables.tolist()
        slots = group.slot_mapping.tolist()
        first_reader: dict = {}
        for i, (row, ctx) in enumerate(zip(tables, meta.context_lens_cpu)):
            for blk in row[:-(-ctx // block_size)]:
                first_reader.setdefault(blk, i)
        for j in range(meta.num_seqs):
            written = {s // block_size for s in slots[qsl[j]:qsl[j + 1]]}
            i = min((first_reader.get(blk, j) for blk in written), default=j)
            if i < j:
                spans.add((qsl[i], qsl[j + 1]))
    return tuple(sorted(spans))


def choose_cuts(meta: AttentionMetadata, num_micro: int, block_size: int) -> list:
    """Rank 0: the token offsets where this step is cut into (up to) num_micro micro-batches."""
    t = meta.num_tokens
    if num_micro <= 1 or t < 2:
        return []
    return cut_points(t, num_micro, forbidden_spans(meta, block_size))


def _slice_meta(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    qsl = _token_starts(meta.query_lens_cpu)
    first = next(i for i in range(meta.num_seqs) if qsl[i + 1] > lo)
    last = next(i for i in range(meta.num_seqs) if qsl[i + 1] >= hi)
    qlens, ctxs = [], []
    for i in range(first, last + 1):
        a, b = max(qsl[i], lo), min(qsl[i + 1], hi)
        qlens.append(b - a)
        ctxs.append(meta.context_lens_cpu[i] - (qsl[i + 1] - b))  # its tokens after hi are not there yet
    starts = _token_starts(qlens)
    dev = meta.context_lens.device
    piece = AttentionMetadata(
        slot_mapping=meta.slot_mapping[lo:hi],
        block_tables=meta.block_tables[first:last + 1],
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        query_lens_cpu=qlens, context_lens_cpu=ctxs, max_query_len=max(qlens), max_context_len=max(ctxs),
        # decodes lead the step; a piece of a prefill is never one, even when it is one token
        num_decode_seqs=max(0, min(meta.num_decode_seqs, last + 1) - first),
    )
    for window, g in meta.window_groups.items():  # each further group's slots and tables, the rest shared
        piece.window_groups[window] = dataclasses.replace(
            piece, slot_mapping=g.slot_mapping[lo:hi], block_tables=g.block_tables[first:last + 1], scratch={},
            window_groups={})
    return piece


def micro_batches(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  cuts: list) -> list:
    """The step's tensors cut at `cuts` (no cuts: the step itself, one micro-batch)."""
    t = meta.num_tokens
    if not cuts:
        return [MicroBatch(0, t, input_ids, positions, meta)]
    bounds = [0, *cuts, t]
    return [MicroBatch(lo, hi, input_ids[lo:hi], positions[lo:hi], _slice_meta(meta, lo, hi))
            for lo, hi in zip(bounds, bounds[1:])]
