"""What a KV hand-over between two local engine processes costs: engine/disaggregated.py's own send path,
timed by part, fitted to latency + bytes / bandwidth (the link sim/disagg.py prices a transfer on).

Two spawned processes, one torch thread each, each with a paged KV cache of LAYERS layers (blocks of
BLOCK_SHAPE, DTYPE). Per sample the sender gathers a run of scattered blocks of every layer into one
contiguous buffer (engine/kv_transfer.gather_blocks, into reused memory: a BufferPool), puts a header on a
multiprocessing queue and sends the bytes on a two-rank ProcessGroupGloo; the receiver reads the header,
receives into a reused tensor and scatters it into its own cache's blocks (scatter_blocks), then acknowledges
(the next sample starts from both processes idle, as a hand-over at low load does). Both stamp perf_counter
(CLOCK_MONOTONIC: one clock for both processes), so each part is timed where it happens: gather, header (put
-> read), bytes (the receive), scatter. The gloo send/recv alone is the `bytes` part; the fitted link is the
whole path's seconds at each size (the lower quartile of the samples), fitted as latency + bytes / bandwidth
(least squares in relative error: the small sizes fix the latency, the large ones the bandwidth).

A few seconds (most of it the two processes starting); cached per machine like the all-reduce link
(measure/local_hardware.local_kv_link).
"""

from __future__ import annotations

import datetime
import queue
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from servescope.analysis.collectives import LOCAL_GLOO, LinkSpec
from servescope.engine.kv_transfer import BufferPool, block_shape, gather_blocks, scatter_blocks
from servescope.parallel.groups import free_port

LAYERS, BLOCK_SHAPE, DTYPE = 30, (16, 4, 64), torch.bfloat16  # 8 KiB per layer's K (or V) block
BLOCK_COUNTS = (1, 4, 16, 64, 160)  # 0.5 MB ... 79 MB sent (all layers, K and V)
RUNS = 7
PARTS = ("gather", "header", "bytes", "scatter")
TIMEOUT_S = 300.0


def _caches(pool: int) -> list:
    return [(torch.randn(pool, *BLOCK_SHAPE).to(DTYPE), torch.randn(pool, *BLOCK_SHAPE).to(DTYPE))
            for _ in range(LAYERS)]


def _blocks(n: int, pool: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool, generator=g)[:n].tolist()  # scattered, as a prefix cache's blocks are


def _side(rank: int, port: int, counts: tuple, runs: int, header, ack, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=TIMEOUT_S))
    pool = 2 * max(counts)
    caches = _caches(pool)
    buffers = BufferPool()  # reused host memory on both sides, as the engine's
    samples = {n: [] for n in counts}
    for r in range(-1, runs):  # round -1: connections, page faults (not kept)
        for n in counts:
            blocks = _blocks(n, pool, seed=1000 * r + n)
            if rank == 1:  # the prefill process
                t0 = time.perf_counter()
                kv = gather_blocks(caches, blocks, buffers.take(block_shape(caches, n), DTYPE))
                t1 = time.perf_counter()
                header.put((tuple(kv.shape), t0, t1))
                group.send([kv.view(-1).view(torch.uint8)], 0, 0).wait()
                buffers.give(kv)
                ack.get(timeout=TIMEOUT_S)
                continue
            shape, t0, t1 = header.get(timeout=TIMEOUT_S)
            t2 = time.perf_counter()
            kv = buffers.take(shape, DTYPE)
            group.recv([kv.view(-1).view(torch.uint8)], 1, 0).wait()
            t3 = time.perf_counter()
            scatter_blocks(caches, blocks, kv)
            t4 = time.perf_counter()
            buffers.give(kv)
            ack.put(None)
            if r >= 0:
                samples[n].append((kv.numel() * kv.element_size(), t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    if rank == 0:
        out.put(samples)


def measure_kv_send(counts: tuple = BLOCK_COUNTS, runs: int = RUNS) -> dict:
    """{bytes sent: {part: seconds, "total": seconds of the whole path}} of the send path at each block count: the
    lower quartile of `runs` samples (_quartile)."""
    ctx = mp.get_context("spawn")
    header, ack, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_side, args=(r, port, tuple(counts), runs, header, ack, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        samples = _wait(out, procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    result = {}
    for rows in samples.values():
        parts = {name: _quartile([row[i + 1] for row in rows]) for i, name in enumerate(PARTS)}
        parts["total"] = _quartile([sum(row[1:]) for row in rows])
        result[rows[0][0]] = parts
    return result


def _quartile(values: list) -> float:
    """The lower quartile: the path's own cost when both processes run (parallel/link_probe.py's reasoning: on
    a shared machine a neighbour taking a core doubles a sample; the median moves with their load)."""
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def _wait(out, procs: list):
    """The receiver's samples; RuntimeError as soon as a side died without them (or after TIMEOUT_S)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return out.get(timeout=0.2)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the KV send probe failed (exit codes {dead})" if dead else
                                   f"the KV send probe took over {TIMEOUT_S:g} s") from None


def fit_kv_send(measured: dict, source: str = "") -> LinkSpec:
    """latency + bytes / bandwidth through the whole path's totals, least squares in relative error."""
    if len(measured) < 2:
        raise ValueError("fit_kv_send needs at least two sizes")
    # minimise sum ((a + b x - t) / t)^2: the normal equations of rows (1/t, x/t) against 1
    rows = [(1.0 / p["total"], b / p["total"]) for b, p in measured.items()]
    s11 = sum(u * u for u, _ in rows)
    s12 = sum(u * v for u, v in rows)
    s22 = sum(v * v for _, v in rows)
    r1, r2 = sum(u for u, _ in rows), sum(v for _, v in rows)
    det = s11 * s22 - s12 * s12
    a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if b <= 0:  # no size dependence measured (noise): the largest size's mean rate
        big = max(measured)
        a, b = 0.0, measured[big]["total"] / big
    largest = max(measured)
    notes = "at {:.1f} MB: ".format(largest / 1e6) + ", ".join(
        f"{name} {1e3 * measured[largest][name]:.2f} ms" for name in PARTS)
    return LinkSpec(LOCAL_GLOO, bandwidth=1.0 / b, latency_s=max(a, 0.0), source=source,
                    notes=f"the KV send path (gather, header, gloo send/recv, scatter); {notes}")
