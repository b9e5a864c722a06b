"""Each step's plan, from rank 0 (the scheduler's process) to every worker, as int64 tensors through
torch.distributed broadcasts: no pickled objects, the same message under torchrun across machines.

A message is a fixed header [HEADER_LEN] then, for a step, one payload: the runner's flat step
buffer (ids, positions, slots, logits index, context lens, query starts, block table, then each further
group's slots and table where the KV cache keeps a block table per group of layers; see
engine/model_runner.step_batch_from_buffer), the row indices whose logits are due, the token offsets where
a pipeline step is cut into micro-batches (parallel/microbatch.py; none: one), then each further group's
table width (the worker knows the groups' windows from its own model and config).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

STOP, STEP, ALLOCATE_KV, REBUILD = 0, 1, 2, 3
HEADER_LEN = 9  # [command, T, B, max blocks, decodes, logits rows, payload length, micro-batch cuts, groups]
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8) + (
    (torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())  # the index travels in a header


@dataclass
class Message:
    command: int
    header: list
    payload: Optional[torch.Tensor] = None

    @property
    def dims(self) -> tuple:
        """(T, B, max blocks per sequence, decodes, logits rows) of a STEP."""
        return tuple(self.header[1:6])

    def step_parts(self) -> tuple:
        """(the runner's step buffer, the logits rows, the micro-batch cuts, the further groups' table widths) of
        a STEP's payload."""
        n, c, g = self.header[5], self.header[7], self.header[8]
        end = self.payload.numel() - n - c - g
        tail = self.payload[end + n:].tolist()
        return self.payload[:end], self.payload[end:end + n], tail[:c], tail[c:]


def _broadcast(t: torch.Tensor, comm=None) -> None:
    if comm is None:
        dist.broadcast(t, src=0)
    else:
        comm.timed(dist.broadcast, t, src=0)


def send_step(batch, logits_indices: torch.Tensor, comm=None, cuts: tuple = ()) -> None:
    """Rank 0: the StepBatch (its buffer), the logits rows and the micro-batch cuts to every rank."""
    t, b = batch.num_tokens, batch.meta.num_seqs
    buf = batch.buffer
    widths = [g.block_tables.shape[1] for g in batch.meta.window_groups.values()]  # (the runner's group order)
    tail = torch.tensor(list(cuts) + widths, dtype=buf.dtype, device=buf.device)
    payload = torch.cat([buf, logits_indices.to(buf.dtype), tail])
    header = [STEP, t, b, batch.meta.block_tables.shape[1], batch.meta.num_decode_seqs,
              logits_indices.numel(), payload.numel(), len(cuts), len(widths)]
    _broadcast(torch.tensor(header, dtype=torch.int64, device=payload.device), comm)
    _broadcast(payload, comm)


def send_command(command: int, args: tuple = (), device: torch.device = torch.device("cpu")) -> None:
    """Rank 0: a command without payload (STOP, or ALLOCATE_KV with its sizes)."""
    header = [command, *args] + [0] * (HEADER_LEN - 1 - len(args))
    _broadcast(torch.tensor(header, dtype=torch.int64, device=device))


def send_rebuild(flat_config: dict, device: torch.device = torch.device("cpu")) -> None:
    """Rank 0: parked workers build another engine's weights (its settings as JSON bytes: plain
    values, no pickle; this happens once per engine, never per step)."""
    data = torch.tensor(list(json.dumps(flat_config).encode()), dtype=torch.uint8, device=device)
    send_command(REBUILD, (data.numel(),), device)
    _broadcast(data)


def rebuild_config(msg: "Message") -> dict:
    return json.loads(bytes(msg.payload.tolist()).decode())


def receive(device: torch.device) -> Message:
    """A worker: the next message from rank 0 (blocks while the engine is idle)."""
    header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    _broadcast(header_t)
    header = header_t.tolist()
    if header[0] == REBUILD:
        data = torch.empty(header[1], dtype=torch.uint8, device=device)
        _broadcast(data)
        return Message(REBUILD, header, data)
    if header[0] != STEP:
        return Message(header[0], header)
    payload = torch.empty(header[6], dtype=torch.int64, device=device)
    _broadcast(payload)
    return Message(STEP, header, payload)
