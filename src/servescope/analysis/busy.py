"""Was the machine quiet while a measurement ran? A measurement taken on a busy machine serves the run that took
it but is never cached (the probe's peaks, a kernel table), or every later prediction would inherit it.

Two signs, over the measurement's window:
- the CPUs its own threads got (process CPU time / wall time) below BUSY_SHARE of the threads it asked for: other
  processes held the cores;
- the CPUs the rest of the machine took (every CPU's busy time from /proc/stat, the hypervisor's steal included,
  less this process's) above OTHERS_MAX. The first sign alone misses oversubscription: a parallel region's thread
  that waits at a barrier for a descheduled sibling spins, and a spinning thread counts as CPU got, so a timing
  inflated several times over could still show its threads at full share. Others' time shows it directly.

Without /proc/stat (not Linux) the second sign is not taken.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

BUSY_SHARE = 0.6  # the least share of its threads' CPUs a quiet measurement gets
# the most CPUs the rest of the machine may take while a measurement runs (daemons, the shell: a few hundredths
# on an idle machine; a neighbour's compile or test run: a whole CPU). SERVESCOPE_BUSY_OTHERS_CPUS sets another
# figure (the test suite: its own niced background jobs run beside every test and are no neighbour to guard the
# caches against; "inf" turns the sign off).
OTHERS_ENV = "SERVESCOPE_BUSY_OTHERS_CPUS"


def others_max(env=os.environ) -> float:
    """OTHERS_MAX as the environment sets it (0.25 CPUs unless OTHERS_ENV says otherwise)."""
    text = env.get(OTHERS_ENV, "0.25")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{OTHERS_ENV} must be a number of CPUs (or inf), got {text!r}") from None
    if not value >= 0:
        raise ValueError(f"{OTHERS_ENV} must be >= 0, got {text!r}")
    return value


OTHERS_MAX = others_max()
BUSY_MIN_WINDOW_S = 0.5  # below this the shares say nothing (tests' tiny probes)
STAT_PATH = "/proc/stat"
# the fields of /proc/stat's "cpu" line that are time not spent idle: user nice system idle iowait irq softirq
# steal (guest time is inside user and nice)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def machine_busy_seconds(path: str = STAT_PATH) -> Optional[float]:
    """Seconds all CPUs of the machine have spent busy (steal included), or None where /proc/stat is not there
    or not in the form expected."""
    try:
        with open(path) as f:
            first = f.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    try:
        return sum(int(first[1 + i]) for i in _BUSY_FIELDS) / ticks
    except ValueError:
        return None


@dataclass(frozen=True)
class Window:
    """What a measurement's window saw: its wall seconds, the CPUs its process got, the CPUs the rest of the
    machine took (None: not known)."""
    seconds: float
    cpus_got: float
    others: Optional[float]

    def busy(self, threads: int) -> bool:
        """Whether a measurement of `threads` threads over this window ran on a busy machine."""
        if self.seconds < BUSY_MIN_WINDOW_S:
            return False
        return self.cpus_got < BUSY_SHARE * threads or (self.others is not None and self.others > OTHERS_MAX)

    def describe(self, threads: int) -> str:
        others = "" if self.others is None else f", the rest of the machine {self.others:.2f}"
        return f"its {threads} threads got {self.cpus_got:.1f} CPUs{others}"


class CpuMeter:
    """Started at a measurement's start; `window()` at its end. The clocks are arguments so that tests can
    stand in for a loaded machine."""

    def __init__(self, own: Callable[[], float] = time.process_time,
                 machine: Callable[[], Optional[float]] = machine_busy_seconds,
                 wall: Callable[[], float] = time.perf_counter):
        self._own, self._machine, self._wall = own, machine, wall
        self._t0, self._own0, self._all0 = wall(), own(), machine()

    def window(self) -> Window:
        seconds = max(self._wall() - self._t0, 1e-9)
        own = self._own() - self._own0
        machine = self._machine()
        others = None
        if machine is not None and self._all0 is not None:
            # the two clocks tick differently (process time in ns, /proc/stat in 10 ms): a few ticks of noise
            others = max(machine - self._all0 - own, 0.0) / seconds
        return Window(seconds, own / seconds, others)
