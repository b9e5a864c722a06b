"""Measure this machine's gloo collectives between local processes (the link of a CPU-parallel
engine): seconds per size, from two processes on localhost, one thread each. The engine's probe
(measure/local_hardware.local_gloo_link) measures the all-reduce at PROBE_SIZES and fits gloo's ring to
them (analysis/collectives.fit_link), and the all-to-all (all_to_all_single, what expert parallelism's
dispatch and combine call) at A2A_PROBE_SIZES, fitted to a call's cost + bytes / bandwidth
(collectives.fit_all_to_all); seconds each, much of it the two processes starting."""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servescope.analysis.collectives import LinkSpec, fit_link
from servescope.parallel.groups import free_port

DEFAULT_SIZES = tuple(8 * 1024 * 4 ** i for i in range(7))  # 8 KiB ... 32 MiB
SIZES_TO_64M = DEFAULT_SIZES + (64 * 2 ** 20,)
PROBE_SIZES = SIZES_TO_64M  # what the engine's probe of its local link measures
# the bytes one rank sends the other in an all-to-all: expert parallelism's dispatch of Tr k / 2 rows [Dm] at
# EP = 2 (a decode step's few KiB up to a 2048-token prefill's tens of MiB); 0: the call alone
A2A_PROBE_SIZES = (0,) + tuple(4 * 1024 * 4 ** i for i in range(7))  # 0, 4 KiB ... 16 MiB
# Before each timed all-to-all rank 0 computes this long while the other rank already waits inside the call:
# an expert-parallel step's pattern (a sparse layer's work between its collectives, one rank arriving after
# the other, whose threads have gone to sleep), not the back-to-back calls of the all-reduce probe, where
# both ranks stay awake. The call then holds waking the waiting peer, which back-to-back calls never pay.
A2A_LEAD_S = 1e-3
WARM_UP = 3  # timed calls per size before the samples (after one untimed)
SAMPLE_S = 20e-3  # one sample: this long of calls of one size (back to back for the all-reduce)
MAX_REPS = 200


def _collective(kind: str, size: int, world: int):
    """One call of the collective `kind` over `size` bytes (all_reduce: the buffer; all_to_all: the bytes sent
    to each other rank, as many kept), ready to repeat."""
    if kind == "all_reduce":
        buf = torch.zeros(size // 4, dtype=torch.float32)  # zeros: sums of ones would reach inf after ~128 rounds
        return lambda: dist.all_reduce(buf)
    inp = torch.zeros(world * (size // 4), dtype=torch.float32)
    out = torch.empty_like(inp)
    splits = [size // 4] * world
    return lambda: dist.all_to_all_single(out, inp, splits, splits)


def _busy(seconds: float) -> None:
    """Compute (a spin on the CPU) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sample(call, reps: int, lead_s: float) -> float:
    """Seconds per call over `reps` calls: back to back (lead_s 0), or each after lead_s of rank 0's compute
    (the call alone timed; rank 0's figure is the one kept)."""
    if not lead_s:
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        return (time.perf_counter() - t0) / reps
    total = 0.0
    for _ in range(reps):
        _busy(lead_s)
        t0 = time.perf_counter()
        call()
        total += time.perf_counter() - t0
    return total / reps


def _rank(rank: int, world: int, port: int, sizes: tuple, runs: int, out, kind: str = "all_reduce",
          lead_s: float = 0.0) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    bufs = {size: _collective(kind, size, world) for size in sizes}
    warm = torch.zeros(len(sizes), dtype=torch.float64)  # seconds per call in the warm-up
    for i, call in enumerate(bufs.values()):
        call()  # connections, buffers, page faults
        t0 = time.perf_counter()
        for _ in range(WARM_UP):
            call()
        warm[i] = (time.perf_counter() - t0) / WARM_UP
    # back-to-back repeats per sample (~SAMPLE_S of them), as the engine issues them: one all-reduce
    # alone on a shared machine mostly times the scheduler's wake-up of the peer. Sized from the
    # warm-up (the slower rank's: both must issue as many), not from a guessed speed, so that a
    # slow link does not make the probe minutes long
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    reps = {size: max(1, min(MAX_REPS, int(SAMPLE_S / (float(t) + lead_s)))) for size, t in zip(sizes, warm)}
    times = {size: [] for size in sizes}
    lead = lead_s if rank == 0 else 0.0  # (the other rank goes straight into each call and waits there)
    for _ in range(runs):  # rounds over every size: a noisy moment spreads over all of them
        for size, call in bufs.items():
            dist.barrier()
            times[size].append(_sample(call, reps[size], lead))
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
    return _measure("all_reduce", sizes, runs, world, statistic)


def measure_all_to_all(sizes: tuple = A2A_PROBE_SIZES, runs: int = 15, world: int = 2,
                       statistic: str = "quartile") -> dict:
    """{bytes sent to each other rank: seconds} of a float32 gloo all_to_all_single over `world` local
    processes, equal splits, each call after A2A_LEAD_S of rank 0's compute with the others waiting in it, as
    an expert-parallel step issues them (the lower quartile of the rounds' samples, as measure_all_reduce's)."""
    return _measure("all_to_all", sizes, runs, world, statistic, A2A_LEAD_S)


def _measure(kind: str, sizes: tuple, runs: int, world: int, statistic: str, lead_s: float = 0.0) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tuple(sizes), runs, out, kind, lead_s), daemon=True)
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


def socket_buffer_bytes(path: str = "/proc/sys/net/ipv4/tcp_rmem") -> int:
    """The receive buffer a new TCP socket starts with here (net.ipv4.tcp_rmem's default: the bytes
    gloo's sender writes before it waits for the peer to read), 0 where the kernel does not say."""
    try:
        with open(path) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def fit_local_link(measured: dict, source: str = "") -> LinkSpec:
    """The local gloo link fitted to all-reduce times {bytes: seconds} of two processes."""
    return fit_link(measured, ranks=2, source=source, buffer_bytes=socket_buffer_bytes())
