"""Worker processes on one machine (torch.multiprocessing, spawn): start, liveness, shutdown.

Workers are daemonic (they end with the engine's process) and each watches its parent: a worker
whose engine died exits within a second instead of waiting on a collective (no orphans). Under
torchrun nothing is started here: torchrun starts every rank and ranks > 0 run the same worker
entry point.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch.multiprocessing as mp

from servescope.errors import WorkerFailedError
from servescope.parallel import plan
from servescope.parallel.groups import destroy_group

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


@dataclass
class ParkedGroup:
    """A healthy group whose engine was shut down with keep_workers: the next parallel engine of the
    same world size, backend and collective timeout in this process sends its workers REBUILD instead of
    spawning (the default process group keeps the timeout it was made with)."""

    workers: WorkerGroup
    store: object  # rank 0's TCPStore (the workers report each rebuild to it)
    world_size: int
    backend: str
    generation: int = 0  # engines built on these workers so far, less one
    timeout_s: float = 0.0  # the process group's collective timeout


_parked: list = []  # at most one ParkedGroup: rank 0 has one default process group


def park(group: ParkedGroup) -> None:
    stop_parked()
    _parked.append(group)


def take_parked(world_size: int, backend: str, timeout_s: float) -> Optional[ParkedGroup]:
    """The parked group when it fits; a parked group that does not fit is stopped (its process group
    must go before a new one starts)."""
    if _parked and (_parked[0].world_size, _parked[0].backend, _parked[0].timeout_s) == (world_size, backend,
                                                                                           timeout_s):
        return _parked.pop()
    stop_parked()
    return None


@atexit.register
def stop_parked() -> None:
    """STOP the parked workers, wait for them, leave the process group."""
    while _parked:
        group = _parked.pop()
        try:
            plan.send_command(plan.STOP)
        except Exception:  # noqa: BLE001 - a broken group: the workers are terminated below
            logger.warning("could not send STOP to the parked workers")
        group.workers.shutdown()
        destroy_group()


def watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """In a worker: exit at once when the engine's process is gone (re-parented)."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(interval)

    threading.Thread(target=loop, name="servescope-parent-watch", daemon=True).start()
