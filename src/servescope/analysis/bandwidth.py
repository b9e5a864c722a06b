"""The read bandwidth that prices a step: the probe's cached figure, checked against a spot check.

A probe is measured once and cached, but on a shared VM the read bandwidth moves by 2x from minute
to minute with the other tenants' traffic, and a cache key (CPU model, flags, threads) cannot tell
whether the machine under it still reads as it did. So whenever a cached probe is used, a spot check
(`spot_read_bandwidth`: the probe's own method on the probe's own 512 MiB, ~0.1 s) is taken beside it,
and `checked_spec` yields the spec in use:

- within TOLERANCE of the cached figure: the cached spec, as it was measured (a spot check is a
  sample of a noisy quantity; the probe's median is the better figure when they agree);
- beyond it: the memory-bound terms follow the spot check. The roofline's bandwidth term becomes
  the spot figure; the probe's linear-kernel rates (weight bytes/s at M rows) are re-priced by
  `rescaled_seconds` (the memory part of a time moves, overlapped with the rest) with the probe's
  bandwidth as their reference. Compute-bound terms (matmul
  peaks, the packed GEMM's and decode attention's FLOP/s, host overheads) stay as cached.

Both figures stay in the spec (`probed_bandwidth`, `spot_bandwidth`) and `bandwidth_origin` says
which one priced the steps. A KernelTable (the engine's own kernels timed at its model's shapes) records
the checked bandwidth it was timed at and the cost model re-prices its ops to the spec's with the same
`rescaled_seconds` (analysis/cost_model._timed_ops).

A spot check's figure is not one sample: the bandwidth of a shared VM can also jump between two levels
(30-37 and 51-62 GB/s on one 2-CPU VM) every few seconds, for minutes on end, so a single 0.1 s read
priced a whole run at whichever level it happened to catch (docs/VALIDATION.md: the 135M decode steps
of one run -18% with a spot check at 62 GB/s, within 4% at 35-37). Every sample the probe and the spot
checks take is kept in a small history beside the probe's cache (`BandwidthHistory`: the last
HISTORY_SAMPLES of the last HISTORY_SECONDS, per CPU and thread count), and the figure a spot check
returns is the median of that history with the new sample in it: the machine's typical bandwidth of the
last hour, which one lucky or unlucky read moves by one place in the order, not to its own value. A read taken
while the rest of the machine was at work (analysis/busy.py: its CPUs over the read) counts in its own run's
median but is not kept (`quiet_read`): a history filled while neighbours ran priced a whole quiet run slow.

Tests (and anyone reproducing a run on the cached figures) switch the spot check off with
SERVESCOPE_BANDWIDTH_SPOT_CHECK=0 (nothing is sampled or written then), or hand a spot check in
(`spot_check=lambda: 40e9`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from statistics import median
from typing import Callable, Optional

from servescope.analysis.busy import CpuMeter
from servescope.analysis.cache_dir import cache_dir
from servescope.analysis.cpu_isa import cpu_model
from servescope.analysis.spec import HardwareSpec
from servescope.timing import median_seconds

# A spot check's median moves by a few percent between back-to-back runs on a quiet machine; beyond
# this a cached figure no longer describes the machine, and half the issue floor's 20% is left for
# everything else the cost model gets wrong.
TOLERANCE = 0.10
SPOT_CHECK_ENV = "SERVESCOPE_BANDWIDTH_SPOT_CHECK"
SPOT_RUNS = 5
# The full probe's buffer (analysis/probe.py), and the spot check's: a smaller one is not the same measurement
# (one of twice the last-level cache read up to 2x high now and then, partly from cache, and the check then
# priced every memory-bound term at that bandwidth; docs/BENCHMARKS.md)
PROBE_BYTES = 512 * 2**20
# The history a spot check's figure is the median of: long enough to hold both levels of a VM that jumps
# between two every few seconds, short enough that a machine whose memory changed for good (another host)
# reads as the new one within an hour (or 8 engine starts)
HISTORY_SAMPLES = 15
HISTORY_SECONDS = 3600.0
# The most CPUs the rest of the machine may take during a read for it to be kept in the history: a 0.1 s read
# sees /proc/stat's 10 ms ticks, so a few ticks of noise are ~0.1 CPU; a neighbour's process at work is ~1.
READ_OTHERS_MAX = 0.5


def measure_read_bandwidth(num_bytes: int = PROBE_BYTES, runs: int = 5, buf=None, warmup: int = 1) -> float:
    """Bytes/s of a streaming float32 read (torch sum), median of `runs`. buf: a float32 tensor to read
    instead of a fresh one of num_bytes (for repeated samples without allocating between them)."""
    import torch  # lazy: importing servescope.analysis must not import torch (2.5 s here)

    x = torch.ones(num_bytes // 4, dtype=torch.float32) if buf is None else buf  # ones: every page touched
    t = median_seconds(lambda: x.sum(), runs, warmup)
    return x.numel() * 4 / t


class BandwidthHistory:
    """The read-bandwidth samples of this CPU and thread count, kept in a JSON file ({key: [[unix time,
    bytes/s], ...]}) beside the probe's cache. An unreadable file is an empty history; writes are atomic
    (a concurrent reader sees the old file or the new one; a concurrent writer's sample may be lost)."""

    def __init__(self, path: Path, key: str, clock: Callable[[], float] = time.time):
        self.path, self.key, self.clock = Path(path), key, clock

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def recent(self, data: Optional[dict] = None) -> list:
        """[[time, bytes/s]] of the last HISTORY_SECONDS, at most HISTORY_SAMPLES, oldest first."""
        now = self.clock()
        rows = (self._read() if data is None else data).get(self.key, [])
        ok = [[float(t), float(b)] for t, b in (r for r in rows if isinstance(r, list) and len(r) == 2)
              if now - HISTORY_SECONDS <= float(t) <= now and float(b) > 0]
        return ok[-HISTORY_SAMPLES:]

    def add(self, bytes_per_s: float, keep: bool = True) -> float:
        """Keep a sample (keep=False: count it in this median only, and write nothing); the median of the recent
        ones, this one included."""
        if not bytes_per_s > 0:
            raise ValueError(f"a read bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        data = self._read()
        rows = (self.recent(data) + [[self.clock(), float(bytes_per_s)]])[-HISTORY_SAMPLES:]
        if not keep:
            return median(b for _, b in rows)
        data[self.key] = rows
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError:
            pass  # a read-only cache: this sample still counts, just not for the next start
        return median(b for _, b in rows)


def local_history() -> BandwidthHistory:
    """This machine's history (beside the probe's cache; its CPU and torch's thread count)."""
    import torch  # lazy: importing servescope.analysis must not import torch (2.5 s here)

    return BandwidthHistory(cache_dir() / "bandwidth.json", f"{cpu_model()}|threads={torch.get_num_threads()}")


def record_sample(bytes_per_s: float, quiet: bool = True) -> None:
    """A sample taken by other means (the full probe's read) kept in the history, unless the spot check is
    switched off (tests: nothing is written then) or the read was not quiet (`quiet_read`)."""
    if default_spot_check() is not None and quiet:
        local_history().add(bytes_per_s)


def quiet_read(window) -> bool:
    """Whether a read's window (analysis/busy.Window) saw the rest of the machine take at most READ_OTHERS_MAX
    CPUs (unknown: quiet). A read taken while neighbours ran measures them too (20-22 GB/s where the quiet machine
    read 34), and a history of such reads priced every memory-bound step slow; it still counts in the run that
    took it (one sample of the median), but is not kept for the next."""
    return window.others is None or window.others <= READ_OTHERS_MAX


def spot_read_bandwidth() -> float:
    """The read bandwidth now, by the probe's method on the probe's buffer size, as the median of the recent
    history with this sample in it (see the module doc); a read on a busy machine is not kept (quiet_read)."""
    meter = CpuMeter()
    bw = measure_read_bandwidth(PROBE_BYTES, SPOT_RUNS)
    return local_history().add(bw, keep=quiet_read(meter.window()))


def default_spot_check() -> Optional[Callable[[], float]]:
    """spot_read_bandwidth, or None where SERVESCOPE_BANDWIDTH_SPOT_CHECK=0 switches it off."""
    return None if os.environ.get(SPOT_CHECK_ENV, "1").strip() == "0" else spot_read_bandwidth


def rescaled_seconds(seconds: float, num_bytes: float, measured_at: float, priced_at: float) -> float:
    """A time measured at bandwidth `measured_at`, priced at `priced_at`. Its memory part m (the bytes at the
    measured bandwidth, at most the whole time) moves with the bandwidth; the rest c is what the time holds
    beyond it, and the two overlap: time = sqrt(c^2 + m^2), a smooth max. So a GEMV at batch 1 (nearly all
    memory) follows the bandwidth, while a 16-row decode GEMM whose reads hide under its arithmetic barely
    moves: measured on a VM whose read bandwidth jumped between ~31 and ~45 GB/s, a 135M decode step at
    batch 1 took 10.2 and 8.2 ms in the two, at batch 16 the same 29 ms (an additive c + m priced the
    latter 10% faster at the faster level; docs/VALIDATION.md). Unknown bandwidths (0) leave the time as
    measured."""
    if measured_at <= 0 or priced_at <= 0 or measured_at == priced_at or seconds <= 0:
        return seconds
    memory = min(seconds, num_bytes / measured_at)
    rest_sq = max(seconds * seconds - memory * memory, 0.0)
    return math.sqrt(rest_sq + (memory * measured_at / priced_at) ** 2)


def _rescaled_rates(rates: dict, measured_at: float, priced_at: float) -> dict:
    """linear_rates ({dtype: [[M, weight bytes/s]]}) re-priced: one byte's time rescaled."""
    return {dt: [[m, 1.0 / rescaled_seconds(1.0 / r, 1.0, measured_at, priced_at)] for m, r in pts]
            for dt, pts in rates.items()}


def checked_spec(cached: HardwareSpec, spot: Optional[float], tolerance: float = TOLERANCE) -> HardwareSpec:
    """The spec in use for a cached probe and a spot check of the bandwidth now (None or 0: not taken, the
    cached spec as it is). See the module doc."""
    if not spot or spot <= 0:
        return cached
    if tolerance < 0:
        raise ValueError(f"the bandwidth tolerance must be >= 0, got {tolerance}")
    probed = cached.memory_bandwidth
    if abs(spot / probed - 1.0) <= tolerance:
        return cached.replace(probed_bandwidth=probed, spot_bandwidth=float(spot))
    return cached.replace(memory_bandwidth=float(spot), probed_bandwidth=probed, spot_bandwidth=float(spot),
                          linear_rates=_rescaled_rates(cached.linear_rates, probed, spot))


def bandwidth_origin(hw: HardwareSpec, tolerance: float = TOLERANCE) -> str:
    """Which bandwidth priced the steps, in words ("" for a spec without a spot check)."""
    if not hw.spot_bandwidth or not hw.probed_bandwidth:
        return ""
    gap = hw.spot_bandwidth / hw.probed_bandwidth - 1.0
    spot, probed = f"{hw.spot_bandwidth / 1e9:.1f} GB/s", f"{hw.probed_bandwidth / 1e9:.1f} GB/s"
    if hw.memory_bandwidth == hw.probed_bandwidth:
        return (f"priced at the probe's cached {probed} (a spot check, the recent samples' median, reads {spot}, "
                f"{gap:+.0%}: within {tolerance:.0%})")
    return (f"priced at a spot check's {spot} (the recent samples' median; {gap:+.0%} against the probe's cached "
            f"{probed}, beyond {tolerance:.0%}: the memory-bound terms follow the spot check)")
