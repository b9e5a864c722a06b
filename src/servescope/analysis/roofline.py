"""The roofline: attainable FLOP/s = min(peak, intensity * bandwidth), and a plot of it.

Plotting uses matplotlib's object API with the Agg canvas directly, so it never changes the
process-wide backend (the server or a notebook may have set one) and needs no display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence, Union

from servescope.analysis.hardware import HardwareSpec


def attainable_flops(hw: HardwareSpec, intensity: float, dtype: str = "bfloat16") -> float:
    """FLOP/s a kernel of `intensity` FLOP/byte can reach on `hw`: min(peak, intensity * bandwidth)."""
    if intensity < 0:
        raise ValueError(f"arithmetic intensity must be >= 0, got {intensity}")
    return min(hw.flops(dtype), intensity * hw.memory_bandwidth)


def plot_roofline(hw: HardwareSpec, points: Sequence[tuple], path: Union[str, Path],
                  dtype: str = "bfloat16", title: Optional[str] = None) -> Path:
    """Write a log-log roofline PNG (or any format matplotlib knows by suffix) and return its path.

    points: (label, arithmetic_intensity FLOP/byte, achieved or predicted FLOP/s) tuples.
    """
    # lazy: importing matplotlib takes over a second, which every `import servescope.analysis` (the
    # engine's, the CLI's) would pay for a plot that most runs never draw
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    peak, bw = hw.flops(dtype), hw.memory_bandwidth
    ridge = peak / bw
    xs_pts = [float(p[1]) for p in points if p[1] > 0]
    lo = min([ridge / 1000] + [x / 2 for x in xs_pts])
    hi = max([ridge * 100] + [x * 2 for x in xs_pts])
    n = 200
    xs = [lo * (hi / lo) ** (k / (n - 1)) for k in range(n)]
    ys = [attainable_flops(hw, x, dtype) for x in xs]

    fig = Figure(figsize=(7.5, 5.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.loglog(xs, ys, color="black", linewidth=2, label="roofline")
    ax.axvline(ridge, color="gray", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(5, -15), fontsize=8)
    ax.annotate(f"{bw / 1e9:.0f} GB/s", (xs[n // 10], ys[n // 10]), textcoords="offset points",
                xytext=(0, 8), fontsize=8, rotation=0)
    ax.annotate(f"peak {dtype} {peak / 1e12:.3g} TFLOP/s", (ridge, peak), textcoords="offset points",
                xytext=(-170, 5), fontsize=8)
    for p in points:
        label, x, y = str(p[0]), float(p[1]), float(p[2])
        if x <= 0 or y <= 0 or not math.isfinite(x):
            continue  # no FLOPs or no bytes: nothing to place on a log-log plot
        ax.plot([x], [y], marker="o", linestyle="none")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"Roofline: {hw.name} ({dtype})")
    ax.grid(True, which="both", linewidth=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path))
    return path
