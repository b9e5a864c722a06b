"""Measure this machine's gloo collectives between local processes (the link of a CPU-parallel
engine): seconds per size, from two processes on localhost, one thread each. The engine's probe
(measure/local_hardware.local_gloo_link) measures the all-reduce at PROBE_SIZES and fits gloo's ring to
them (analysis/link_fit.fit_link), and the other collectives a parallel step issues, in a step's order
(measure_step_collectives: the step plan's broadcasts, and expert parallelism's all-gathers and
all_to_all_single at A2A_PROBE_SIZES), fitted to a call's cost + bytes / bandwidth each
(link_fit.fit_step_collectives); seconds each, much of it the two processes starting."""

from __future__ import annotations

import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servescope.analysis.collectives import LinkSpec
from servescope.analysis.link_fit import fit_link, relative_spread
from servescope.parallel.groups import free_port
from servescope.parallel.plan import HEADER_LEN

DEFAULT_SIZES = tuple(8 * 1024 * 4 ** i for i in range(7))  # 8 KiB ... 32 MiB
SIZES_TO_64M = DEFAULT_SIZES + (64 * 2 ** 20,)
PROBE_SIZES = SIZES_TO_64M  # what the engine's probe of its local link measures
# the bytes one rank sends the other in an all-to-all: expert parallelism's dispatch of Tr k / 2 rows [Dm] at
# EP = 2 (a decode step's few KiB up to a 2048-token prefill's tens of MiB); 0: the call alone
A2A_PROBE_SIZES = (0,) + tuple(4 * 1024 * 4 ** i for i in range(7))  # 0, 4 KiB ... 16 MiB
# The compute between a step's collectives in the probe of them: rank 0's own before the plan (the scheduler,
# the last step's head and sampling) while the others wait in its broadcast, every rank's before a sparse
# layer's all-gather and before its combine (attention, the experts), each long enough for a waiting peer's
# threads to have gone to sleep, which back-to-back calls never let them do.
LEAD_S = 1e-3
EP_LAYERS = 8  # sparse layers per probed step
COUNTS_INTS = 64  # a probed layer's tokens per expert: [E] int64 (its all-gather's bytes are a few hundred)
PLAN_INTS = 10  # a probed plan's payload: a one-token decode step's (plan.py: 3 T + 3 B + 1 + its blocks)
# The ranks' spread on equal work (LinkSpec.desync): rounds of every rank reading DESYNC_BYTES at once (memory-bound,
# as a sparse layer's experts read their weights: tens of MiB on one thread, past the last-level cache), each
# timing its own
DESYNC_BYTES = 64 << 20
DESYNC_ROUNDS = 24
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


def _sample(call, reps: int) -> float:
    """Seconds per call over `reps` calls back to back (rank 0's figure is the one kept)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t0) / reps


def _rank(rank: int, world: int, port: int, sizes: tuple, runs: int, out, kind: str = "all_reduce") -> None:
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
    reps = {size: max(1, min(MAX_REPS, int(SAMPLE_S / float(t)))) for size, t in zip(sizes, warm)}
    times = {size: [] for size in sizes}
    for _ in range(runs):  # rounds over every size: a noisy moment spreads over all of them
        for size, call in bufs.items():
            dist.barrier()
            times[size].append(_sample(call, reps[size]))
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


def measure_step_collectives(sizes: tuple = A2A_PROBE_SIZES, runs: int = 15, world: int = 2,
                             statistic: str = "quartile") -> dict:
    """{kind: {bytes: seconds}} of the collectives besides the all-reduce that a parallel step issues, timed in a
    step's order over `world` local processes (_step_rank): "plan", the step plan's two broadcasts {payload
    bytes: s}; "all_to_all", expert parallelism's dispatch and combine {bytes sent to each other rank: s};
    "all_gather", its tokens-per-expert and outputs' all-gathers, per call {their mean bytes per rank: s}; and
    "desync": {DESYNC_BYTES: the ranks' spread on equal work} (link_fit.relative_spread of their times). Per
    size, the lower quartile of the rounds' samples (as measure_all_reduce's), each sample one step's mean per
    call: a call right after another is often ~1 ms slower than one after compute (its peer's thread not woken
    at once), so a lone call's quartile would miss what a step pays, while a step's mean over its layers holds
    it."""
    return _measure("step", sizes, runs, world, statistic)


def _step_rank(rank: int, world: int, port: int, sizes: tuple, runs: int, out) -> None:
    """One rank of measure_step_collectives: per size, steps of the plan's broadcasts (after LEAD_S of rank 0's
    work, the others waiting) and EP_LAYERS sparse layers: LEAD_S of every rank's compute, the tokens-per-expert
    all-gather, the dispatch at once, LEAD_S, the combine, the outputs' all-gather at once (each rank's slice of
    the size's bytes). Each sample: one step's seconds per call of each kind, rank 0's."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13's name)
    header, payload = torch.zeros(HEADER_LEN, dtype=torch.int64), torch.zeros(PLAN_INTS, dtype=torch.int64)
    counts, every = torch.zeros(COUNTS_INTS, dtype=torch.int64), torch.empty(world * COUNTS_INTS, dtype=torch.int64)
    times = {"plan": {}, "all_to_all": {}, "all_gather": {}}

    def step(size: int, a2a, mine, outs) -> dict:
        """One probed step: {kind: (bytes, seconds per call)}. A layer's two calls of a kind are averaged (the one
        after compute, the one right after a call: a step always pays both), the all-gathers at their mean bytes
        (the tokens per expert's and the slice's: call + bytes / rate is linear, so the mean prices the pair)."""
        if rank == 0:
            _busy(LEAD_S)
        t0 = time.perf_counter()
        dist.broadcast(header, src=0)
        dist.broadcast(payload, src=0)
        t = {"plan": time.perf_counter() - t0, "all_to_all": 0.0, "all_gather": 0.0}
        for _ in range(EP_LAYERS):
            _busy(LEAD_S)
            t0 = time.perf_counter()
            gather(every, counts)
            t1 = time.perf_counter()
            a2a()
            t2 = time.perf_counter()
            _busy(LEAD_S)
            t3 = time.perf_counter()
            a2a()
            t4 = time.perf_counter()
            gather(outs, mine)
            t5 = time.perf_counter()
            t["all_to_all"] += (t2 - t1 + t4 - t3) / 2 / EP_LAYERS
            t["all_gather"] += (t1 - t0 + t5 - t4) / 2 / EP_LAYERS
        nbytes = {"plan": payload.numel() * 8, "all_to_all": size,
                  "all_gather": (counts.numel() * 8 + mine.numel() * 4) // 2}
        return {kind: (nbytes[kind], seconds) for kind, seconds in t.items()}

    bufs = {size: (_collective("all_to_all", size, world), torch.zeros(max(1, size // 4)),
                   torch.empty(world * max(1, size // 4))) for size in sizes}
    for size, buf in bufs.items():
        step(size, *buf)  # connections, buffers, page faults
    for _ in range(runs):
        plans = []  # the round's plans, one a step: their mean is the round's sample, as a layer's calls are
        for size, buf in bufs.items():
            dist.barrier()
            for kind, (nbytes, dt) in step(size, *buf).items():
                if kind == "plan":
                    plans.append(dt)
                else:
                    times[kind].setdefault(nbytes, []).append(dt)
        times["plan"].setdefault(payload.numel() * 8, []).append(sum(plans) / len(plans))
    rounds = _equal_work(gather, world)
    dist.destroy_process_group()
    times["desync"] = {DESYNC_BYTES: rounds}
    if rank == 0:
        out.put(times)


def _equal_work(gather, world: int) -> list:
    """DESYNC_ROUNDS rounds of every rank reading DESYNC_BYTES at once after a barrier: [[each rank's seconds]]
    per round (every rank's, all-gathered)."""
    buf = torch.ones(DESYNC_BYTES // 4)
    buf.sum()  # page faults
    mine = torch.zeros(DESYNC_ROUNDS, dtype=torch.float64)
    for i in range(DESYNC_ROUNDS):
        dist.barrier()
        t0 = time.perf_counter()
        buf.sum()
        mine[i] = time.perf_counter() - t0
    every = torch.empty(world * DESYNC_ROUNDS, dtype=torch.float64)
    gather(every, mine)
    return every.view(world, DESYNC_ROUNDS).t().tolist()


def _measure(kind: str, sizes: tuple, runs: int, world: int, statistic: str) -> dict:
    """Run `kind`'s probe ("all_reduce", or "step": _step_rank) over `world` spawned processes; rank 0's samples,
    each size's reduced by `statistic` ({bytes: s}; {kind: {bytes: s}} for "step")."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    target, args = (_step_rank, ()) if kind == "step" else (_rank, (kind,))
    procs = [ctx.Process(target=target, args=(r, world, port, tuple(sizes), runs, out) + args, daemon=True)
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
    if kind == "step":
        spread = {size: relative_spread(rounds) for size, rounds in result.pop("desync").items()}
        return {**{k: {size: pick(ts) for size, ts in by_size.items()} for k, by_size in result.items()},
                "desync": spread}
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
