"""Worker processes on one machine (torch.multiprocessing, spawn): start, liveness, shutdown.

Workers are daemonic (they end with the engine's process) and each watches its parent: a worker
whose engine died exits within a second instead of waiting on a collective (no orphans). Under
torchrun nothing is started here: torchrun starts every rank and ranks > 0 run the same worker
entry point.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch.multiprocessing as mp

from servescope.errors import WorkerFailedError

logger = logging.getLogger(__name__)


class WorkerGroup:
    """Ranks 1..world-1 as processes running `target(rank, *args, parent_pid)`."""

    def __init__(self, target: Callable, world_size: int, args: tuple):
        ctx = mp.get_context("spawn")
        self.procs = []
        for rank in range(1, world_size):
            p = ctx.Process(target=target, args=(rank, *args, os.getpid()), daemon=True,
                            name=f"servescope-worker-{rank}")
            p.start()
            self.procs.append(p)

    @property
    def pids(self) -> list:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        """WorkerFailedError naming each worker that has exited."""
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        if dead:
            raise WorkerFailedError("; ".join(f"worker rank {r} exited with code {c}" for r, c in dead))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Wait for the workers to exit (after a STOP), then terminate, then kill what is left."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                logger.warning("worker %s did not stop; terminating it", p.name)
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)


def watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """In a worker: exit at once when the engine's process is gone (re-parented)."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(interval)

    threading.Thread(target=loop, name="servescope-parent-watch", daemon=True).start()
