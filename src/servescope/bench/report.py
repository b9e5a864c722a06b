"""Presenting benchmark results: a rich table in vLLM's layout and the latency-vs-throughput plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from rich.table import Table

from servescope.bench.metrics import LATENCY_METRICS, BenchmarkResult, percentile_key

_SECTION_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def render_result_table(result: BenchmarkResult) -> Table:
    """The summary `vllm bench serve` prints, as a two-column rich Table."""
    table = Table(title="Serving Benchmark Result", show_header=False, box=None, pad_edge=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    cfg = result.config
    if cfg.get("max_concurrency") is not None:
        table.add_row("Maximum request concurrency:", str(cfg["max_concurrency"]))
    if "request_rate" in cfg:
        table.add_row("Request rate (req/s):", str(cfg["request_rate"]))
    table.add_row("Successful requests:", str(result.completed))
    table.add_row("Failed requests:", str(result.failed))
    table.add_row("Benchmark duration (s):", f"{result.duration_s:.2f}")
    table.add_row("Total input tokens:", str(result.total_input_tokens))
    table.add_row("Total generated tokens:", str(result.total_output_tokens))
    table.add_row("Request throughput (req/s):", f"{result.request_throughput:.2f}")
    if result.request_goodput is not None:
        table.add_row("Request goodput (req/s):", f"{result.request_goodput:.2f}")
    table.add_row("Output token throughput (tok/s):", f"{result.output_throughput:.2f}")
    table.add_row("Total token throughput (tok/s):", f"{result.total_token_throughput:.2f}")
    table.add_row("Peak concurrent requests:", str(result.max_concurrency_seen))
    for name in LATENCY_METRICS:
        title, short = _SECTION_TITLES[name]
        stats = getattr(result, name)
        table.add_section()
        table.add_row(f"[cyan]{title}[/cyan]", "")
        table.add_row(f"Mean {short} (ms):", f"{stats.mean_ms:.2f}")
        table.add_row(f"Median {short} (ms):", f"{stats.median_ms:.2f}")
        for p, v in stats.percentiles_ms.items():
            table.add_row(f"{percentile_key(p).upper()} {short} (ms):", f"{v:.2f}")
    return table


def plot_sweep(results: Sequence[BenchmarkResult], path: str) -> None:
    """Latency vs throughput: output tok/s on x; median and p99 TTFT (left) and TPOT (right) on y.

    Each point is one request rate, labelled with it. p99 needs 99 in the results'
    percentiles; it is skipped otherwise.
    """
    if not results:
        raise ValueError("no results to plot")
    # The Agg canvas directly, not pyplot: no display needed, no global backend switch.
    # lazy: importing matplotlib takes over a second, and servescope.bench (which imports this module)
    # is imported by every bench run, most of which draw no plot
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    xs = [r.output_throughput for r in results]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, name, label in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        stats = [getattr(r, name) for r in results]
        ax.plot(xs, [s.median_ms for s in stats], "o-", label=f"median {label}")
        if all(99.0 in s.percentiles_ms for s in stats):
            ax.plot(xs, [s.percentiles_ms[99.0] for s in stats], "s--", label=f"p99 {label}")
        for r, x, s in zip(results, xs, stats):
            rate = r.config.get("request_rate", "?")
            ax.annotate(f"{rate} req/s", (x, s.median_ms), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(f"{label} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=120)


def save_results_json(results: BenchmarkResult | Sequence[BenchmarkResult], path: str | Path,
                      include_records: bool = False) -> None:
    """Write one result (a JSON object) or several (a JSON list) with `to_dict`'s stable keys."""
    if isinstance(results, BenchmarkResult):
        data = results.to_dict(include_records)
    else:
        data = [r.to_dict(include_records) for r in results]
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
