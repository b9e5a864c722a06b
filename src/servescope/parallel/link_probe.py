"""Measure this machine's gloo all-reduce between local processes (the link of a CPU-parallel
engine): median seconds per size, from two processes on localhost, one thread each."""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servescope.parallel.groups import free_port

DEFAULT_SIZES = tuple(8 * 1024 * 4 ** i for i in range(7))  # 8 KiB ... 32 MiB
SIZES_TO_64M = DEFAULT_SIZES + (64 * 2 ** 20,)
PROBE_SIZES = SIZES_TO_64M  # what `hardware probe-link` (the engine's cached local link) measures
WARM_UP = 3  # all-reduces per size before any is timed: connections, buffers, page faults


def _rank(rank: int, world: int, port: int, sizes: tuple, runs: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    # zeros: repeated sums of ones would reach inf after ~128 rounds
    bufs = {size: torch.zeros(size // 4, dtype=torch.float32) for size in sizes}
    for buf in bufs.values():
        for _ in range(WARM_UP):
            dist.all_reduce(buf)
    # back-to-back repeats per sample (at least ~20 ms of them), as the engine issues them: one
    # all-reduce alone on a shared machine mostly times the scheduler's wake-up of the peer
    reps = {size: max(1, min(200, int(20e-3 / (50e-6 + size / 1e9)))) for size in sizes}
    times = {size: [] for size in sizes}
    for _ in range(runs):  # rounds over every size: a noisy moment spreads over all of them
        for size, buf in bufs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps[size]):
                dist.all_reduce(buf)
            times[size].append((time.perf_counter() - t0) / reps[size])
    dist.destroy_process_group()
    if rank == 0:
        out.put(times)


def measure_all_reduce(sizes: tuple = SIZES_TO_64M, runs: int = 15, world: int = 2,
                       statistic: str = "quartile") -> dict:
    """{bytes: seconds} of a float32 gloo all-reduce over `world` local processes: the lower quartile
    of the rounds' samples (statistic "quartile"; "median", "min" also): on a shared 2-core machine
    another process taking a core doubles a sample, so the median moves with the neighbours' load from
    one minute to the next, while the lower quartile is the link's own speed when both processes run
    (what the cost model predicts) and repeats within a few percent."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tuple(sizes), runs, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    pick = {"quartile": lambda ts: statistics.quantiles(ts, n=4)[0] if len(ts) > 1 else ts[0],
            "median": statistics.median, "min": min}[statistic]
    return {size: pick(ts) for size, ts in result.items()}
