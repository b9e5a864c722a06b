"""servescope.bench: client-side serving benchmarks against any OpenAI-compatible server."""

from servescope.bench.arrivals import arrival_gaps, arrival_times
from servescope.bench.datasets import BenchRequest, random_requests
from servescope.bench.metrics import BenchmarkResult, LatencyStats, RequestRecord, compute_metrics, parse_goodput
from servescope.bench.report import plot_sweep, render_result_table, save_results_json
from servescope.bench.serve_client import run_serve_benchmark, run_serve_benchmark_async, sweep

__all__ = [
    "BenchRequest", "BenchmarkResult", "LatencyStats", "RequestRecord", "arrival_gaps", "arrival_times",
    "compute_metrics", "parse_goodput", "plot_sweep", "random_requests", "render_result_table",
    "run_serve_benchmark", "run_serve_benchmark_async", "save_results_json", "sweep",
]
