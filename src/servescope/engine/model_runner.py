"""ModelRunner: the only place that turns a scheduler decision into tensors.

Shape legend: T tokens in the step, B sequences, M max blocks per sequence, N blocks,
S block size, Hkv KV heads, D head dim, V vocabulary, L layers.

It owns the model weights and the paged KV cache (per layer a K and a V tensor of shape
[N, S, Hkv, D]); it never decides anything: what runs is in the SchedulerOutput.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from servescope.config import ModelConfig
from servescope.model.attention import kv_quant
from servescope.model.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """The flat tensors of one step, before the forward pass."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [B]: index in T of each row's last new token
    num_tokens: int
    # the one int64 buffer the tensors above are views of (what a parallel executor sends to its workers)
    buffer: Optional[torch.Tensor] = None
    # row offsets of each scheduled sequence [len(scheduled) + 1]: a sequence verifying k drafts is laid
    # out as 1 + k one-token rows (one logits position each); any other sequence is one row
    seq_rows: Optional[list] = None

    def sample_positions(self, seq_indices: list) -> list:
        """Rows whose logits the scheduled sequences at seq_indices need, in order."""
        r = self.seq_rows
        return [j for i in seq_indices for j in range(r[i], r[i + 1])]


def step_batch_from_buffer(buf: torch.Tensor, t: int, b: int, max_blocks: int, num_decode: int,
                           query_lens: Optional[list] = None, context_lens: Optional[list] = None,
                           seq_rows: Optional[list] = None, groups: tuple = ()) -> StepBatch:
    """The StepBatch whose tensors are views of `buf` (layout: ids, positions, slots [T] | logits index,
    context lens [B] | query starts [B+1] | block table [B*M], then per further group (window, M_g) in
    `groups`: its slots [T] | its block table [B*M_g]); the host lists are read back from it when not given
    (a worker that received the buffer)."""
    o = 3 * t
    if query_lens is None:
        host = buf[o + b:o + 3 * b + 1].tolist()
        context_lens, qsl = host[:b], host[b:]
        query_lens = [qsl[i + 1] - qsl[i] for i in range(b)]
    meta = AttentionMetadata(
        slot_mapping=buf[2 * t:3 * t],
        block_tables=buf[o + 3 * b + 1:o + 3 * b + 1 + b * max_blocks].view(b, max_blocks).to(torch.int32),
        context_lens=buf[o + b:o + 2 * b].to(torch.int32),
        query_start_loc=buf[o + 2 * b:o + 3 * b + 1].to(torch.int32),
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        num_decode_seqs=num_decode,
    )
    g = o + 3 * b + 1 + b * max_blocks
    for window, m in groups:  # the other groups' slots and tables; the rest of their metadata is shared
        meta.window_groups[window] = dataclasses.replace(
            meta, slot_mapping=buf[g:g + t], block_tables=buf[g + t:g + t + b * m].view(b, m).to(torch.int32),
            scratch={}, window_groups={})
        g += t + b * m
    return StepBatch(input_ids=buf[:t], positions=buf[t:2 * t], meta=meta, logits_indices=buf[o:o + b],
                     num_tokens=t, buffer=buf, seq_rows=seq_rows)


class ModelRunner:
    def __init__(self, executor, model_config: ModelConfig, backend: AttentionBackend,
                 num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                 kv_caches: Optional[list] = None, group_blocks: Optional[dict] = None):
        """kv_caches: another runner's cache to read and write instead of a new one (a self-speculation
        draft, the target's own weights quantised, reads the target's KV: spec/draft.py). group_blocks: a
        block table per group of layers of one window (kvcache/hybrid.py): window -> the blocks of its pool
        (a layer's cache tensors have its group's); None: one table, num_blocks blocks, for all layers."""
        self.executor = executor  # engine/executor.py: the model and its kernel choices
        self.cfg = model_config
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype
        heads, k_dim, v_dim = model_config.kv_cache_geometry
        # one K and one V tensor per layer: [N, S, Hkv, D] ([..., D + 4] int8 / fp8 rows with their scales); latent
        # attention: its latent rows [N, S, 1, r + R] and an empty V (model/mla.py)
        windows = [spec.attention.window for spec in model_config.layer_specs()]
        self.layer_windows = tuple(windows)  # (a layer's group: the KV manager's group of its window)
        # the windows of the groups after the first, in the KV manager's order (its tables' order)
        self.group_windows = tuple(sorted(group_blocks))[1:] if group_blocks else ()
        self.group_blocks = dict(group_blocks) if group_blocks else None
        # the blocks of the first group's pool, which ScheduledSequence.block_ids index (one table: all blocks)
        self.table_blocks = group_blocks[min(group_blocks)] if group_blocks else num_blocks
        self.kv_caches = kv_caches if kv_caches is not None else [
            (kv_quant.allocate(n, block_size, heads, k_dim, kv_dtype, device),
             kv_quant.allocate(n, block_size, heads, v_dim, kv_dtype, device))
            for n in (group_blocks[w] if group_blocks else num_blocks for w in windows)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over every layer (whatever the layer's pool)."""
        return sum((k.numel() * k.element_size() + v.numel() * v.element_size()) // (k.shape[0] * self.block_size)
                   for k, v in self.kv_caches)

    def prepare(self, scheduled) -> StepBatch:
        """scheduled: list of ScheduledSequence (decodes first). Builds flat host lists, then one
        copy per tensor to the device."""
        s = self.block_size
        input_ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        groups = [([], []) for _ in self.group_windows]  # the other groups' (slots, tables)
        num_decode = 0
        seq_rows = [0]
        for seq in scheduled:
            start, n = seq.num_computed_tokens, seq.num_new_tokens
            spec = seq.spec_token_ids
            blocks = seq.block_ids
            if groups:
                _group_rows(groups, seq.group_block_ids[1:], start, n, s, bool(spec))
            if spec:
                # a verification: 1 + k one-token rows over the same block table, row j at position
                # start + j attending over start + j + 1 tokens. All rows' KV is stored before any row's
                # attention reads it (the backend invariant), so each row sees the drafts before it:
                # causal attention of a (1 + k)-token query, on the decode kernels.
                toks = seq.token_ids()
                for j in range(n):
                    input_ids.append(toks[j])
                    positions.append(start + j)
                    slots.append(blocks[(start + j) // s] * s + (start + j) % s)
                    query_lens.append(1)
                    context_lens.append(start + j + 1)
                    tables.append(blocks)
                    num_decode += num_decode == len(query_lens) - 1
                seq_rows.append(len(query_lens))
                continue
            toks = seq.request.all_token_ids
            input_ids.extend(toks[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // s] * s + p % s for p in range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(blocks)
            if n == 1 and num_decode == len(query_lens) - 1:
                num_decode += 1  # decodes lead the batch; count the leading run of 1-token queries
            seq_rows.append(len(query_lens))
        return self._batch(input_ids, positions, slots, query_lens, context_lens, tables, num_decode, seq_rows,
                           groups)

    def one_token_rows(self, ids, positions: list, tables: list) -> StepBatch:
        """The batch of n one-token decode rows (a draft model's step, spec/draft.py): row i feeds ids[i]
        at positions[i] through its block tables tables[i] (one per group of layers, the KV manager's order:
        Scheduler.reserve_lookahead); its logits are row i. ids: a host list, or a device tensor [n] (the
        previous draft step's argmaxes, never copied to the host)."""
        s, n = self.block_size, len(positions)
        first = [t[0] for t in tables]
        slots = [b[p // s] * s + p % s for p, b in zip(positions, first)]
        groups = [([], []) for _ in self.group_windows]
        if groups:
            for p, t in zip(positions, tables):
                _group_rows(groups, t[1:], p, 1, s, False)
        batch = self._batch(ids if isinstance(ids, list) else [0] * n, list(positions), slots, [1] * n,
                            [p + 1 for p in positions], first, n, groups=groups)
        if not isinstance(ids, list):
            batch.input_ids.copy_(ids)  # a view of the step's buffer
        return batch

    def _batch(self, input_ids: list, positions: list, slots: list, query_lens: list, context_lens: list,
               tables: list, num_decode: int, seq_rows: Optional[list] = None, groups: list = ()) -> StepBatch:
        max_blocks = max(len(t) for t in tables)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        t, b = len(input_ids), len(query_lens)
        # One host buffer, one copy to the device, then views: on a GPU each separate small copy
        # would cost a synchronous transfer. Layout: ids, positions, slots [T] | logits index,
        # context lens [B] | query starts [B+1] | block table [B*M].
        flat = input_ids + positions + slots + [x - 1 for x in qsl[1:]] + context_lens + qsl
        for row in tables:
            flat.extend(row)
            flat.extend([0] * (max_blocks - len(row)))
        shapes = []
        for window, (g_slots, g_tables) in zip(self.group_windows, groups):  # then each further group's
            m = max(len(row) for row in g_tables)
            flat.extend(g_slots)
            for row in g_tables:
                flat.extend(row)
                flat.extend([0] * (m - len(row)))
            shapes.append((window, m))
        buf = torch.tensor(flat, dtype=torch.int64)
        if self.device.type != "cpu":
            buf = buf.to(self.device, non_blocking=True)
        return step_batch_from_buffer(buf, t, b, max_blocks, num_decode, query_lens, context_lens, seq_rows,
                                      tuple(shapes))

    @torch.inference_mode()
    def execute(self, scheduled, sample_rows: Optional[list] = None,
                extra_positions: Optional[list] = None) -> torch.Tensor:
        """Run one step. Returns float32 logits [P, V] at the sample positions of the sequences in
        sample_rows (indices into `scheduled`; default all): one per sequence, 1 + k for a sequence
        verifying k drafts, in order; followed by [E, V] at `extra_positions`: (row, lo, hi) asks for
        the logits of that row's new tokens lo..hi-1 (offsets in its chunk), e.g. for prompt logprobs."""
        batch = self.prepare(scheduled)
        if sample_rows is None:
            idx = batch.logits_indices
        elif len(batch.seq_rows) - 1 == batch.meta.num_seqs:  # one row per sequence
            idx = batch.logits_indices[sample_rows]
        else:
            idx = batch.logits_indices[batch.sample_positions(sample_rows)]
        if extra_positions:
            qsl = _starts(batch.meta.query_lens_cpu)
            extra = [qsl[row] + j for row, lo, hi in extra_positions for j in range(lo, hi)]
            idx = torch.cat([idx, torch.tensor(extra, dtype=idx.dtype).to(idx.device)])
        return self.executor.run(batch, self.kv_caches, self.backend, idx)  # [P + E, V]


def _group_rows(groups: list, tables: tuple, start: int, n: int, s: int, one_token_rows: bool) -> None:
    """Append one sequence's slots and table rows of each further group to `groups` ((slots, tables) each):
    n positions from `start`, as one row, or as n one-token rows (a verification: prepare())."""
    for (g_slots, g_tables), blocks in zip(groups, tables):
        g_slots.extend(blocks[p // s] * s + p % s for p in range(start, start + n))
        g_tables.extend([blocks] * (n if one_token_rows else 1))


def _starts(query_lens: list) -> list:
    """Flat index of each sequence's first new token."""
    out, acc = [], 0
    for q in query_lens:
        out.append(acc)
        acc += q
    return out
