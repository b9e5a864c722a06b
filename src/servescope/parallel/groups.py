"""Process groups: start one (a localhost TCP store from torch.multiprocessing, or torchrun's env://), the
tensor-parallel group of each stage, and the time every collective takes (a StepRecord's
communication time).

gloo serves the CPU (it is the only torch backend with CPU tensors everywhere), NCCL CUDA tensors.
Every rank creates every tensor-parallel group in the same order (torch.distributed's rule), even
the groups it is not in.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from servescope.parallel.layout import ParallelLayout

# workers wait for the next step as long as the engine is idle: only rank 0 uses the configured timeout
WORKER_TIMEOUT_S = 7 * 24 * 3600.0
START_TIMEOUT_S = 900.0  # for the workers to load their weights (a dead one is reported at once)


def free_port() -> int:
    """A TCP port free on localhost now (the store binds it a moment later; a race we accept)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device, asked: str = "auto") -> str:
    return ("nccl" if device.type == "cuda" else "gloo") if asked == "auto" else asked


@dataclass
class CommStats:
    """Seconds and bytes of this rank's collectives since the last `take()` (one step's)."""

    seconds: float = 0.0
    bytes: int = 0

    def timed(self, fn, tensor: torch.Tensor, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(tensor, *args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.bytes += tensor.numel() * tensor.element_size()
        return out

    def wait(self, work, tensor: torch.Tensor) -> None:
        """Wait for an asynchronous send/receive of `tensor` (its time in the wait is what it cost
        this rank: the transfer overlapped with compute is free)."""
        t0 = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - t0
        self.bytes += tensor.numel() * tensor.element_size()

    def take(self) -> tuple:
        out = (self.seconds, self.bytes)
        self.seconds, self.bytes = 0.0, 0
        return out


@dataclass
class ExpertTraffic:
    """Expert parallelism on this rank since the last `take()` (one step's): seconds and bytes sent in its
    all-to-alls, and the (token, expert) rows each expert-parallel rank's experts ran (every rank's, known
    from the counts every rank shares), summed over the sparse layers."""

    seconds: float = 0.0
    bytes: int = 0
    rows_per_rank: list = field(default_factory=list)

    def add_rows(self, rows: list) -> None:
        self.rows_per_rank = [a + b for a, b in zip(self.rows_per_rank, rows)] if self.rows_per_rank else list(rows)

    def take(self) -> tuple:
        out = (self.seconds, self.bytes, self.rows_per_rank)
        self.seconds, self.bytes, self.rows_per_rank = 0.0, 0, []
        return out


@dataclass
class DistContext:
    """This rank's place in the layout and the groups it talks on."""

    layout: ParallelLayout
    rank: int
    tp_group: object = None  # None: the default group (P == 1, where the TP group is everyone)
    comm: CommStats = field(default_factory=CommStats)
    experts: ExpertTraffic = field(default_factory=ExpertTraffic)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def shard(self) -> int:
        return self.layout.shard_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pp - 1

    @property
    def tp_root(self) -> int:
        """The global rank of this stage's shard 0 (where the head's logits are gathered)."""
        return self.layout.rank_of(self.stage, 0)


def master_store(port: int, world_size: int) -> "dist.TCPStore":
    """Rank 0's key-value store on localhost:port (the workers report to it once their weights are built)."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))


def worker_store(port: int, world_size: int) -> "dist.TCPStore":
    """A worker's connection to rank 0's store."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))


def mark_ready(store, rank: int, generation: int = 0) -> None:
    """A worker: its weights for engine number `generation` on these processes are built."""
    store.set(f"servescope/ready/{rank}/{generation}", "1")


def wait_ready(store, world_size: int, check_alive, timeout_s: float, generation: int = 0) -> None:
    """Rank 0: wait until every worker is ready, calling check_alive() (which raises for a dead
    worker) meanwhile, so that a worker that fails while loading is reported at once."""
    deadline = time.monotonic() + timeout_s
    keys = [f"servescope/ready/{r}/{generation}" for r in range(1, world_size)]
    while not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the parallel workers were not ready within {timeout_s:g} s")
        time.sleep(0.05)


def init_group(layout: ParallelLayout, rank: int, backend: str, store, timeout_s: float) -> DistContext:
    """Join the process group (store None: torchrun's env://) and make the TP groups."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world_size, timeout=timeout)
    return context(layout, rank, timeout_s)


def context(layout: ParallelLayout, rank: int, timeout_s: float) -> DistContext:
    """This rank's DistContext in the joined group, with the TP groups of `layout` (made again for
    every engine: the layout may differ from the last one on the same processes)."""
    tp_group = None
    if layout.pp > 1 and layout.width > 1:
        for stage in range(layout.pp):
            g = dist.new_group(layout.tp_group_ranks(stage), timeout=datetime.timedelta(seconds=timeout_s))
            if layout.stage_of(rank) == stage:
                tp_group = g
    return DistContext(layout, rank, tp_group)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_rank() -> Optional[tuple]:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
