"""Server throughput with and without the dashboard open: the cost of watching.

Starts `servescope serve` (the embedded model unless --model) and runs the same `servescope bench
serve` load in interleaved rounds, three ways:
  none      nobody watches;
  feed      `bench serve --dashboard`: a headless reader of /v1/internals/stream (the server's side
            of the cost: the snapshots and their encoding);
  browser   a headless Chromium (Playwright, the system chromium) with /dashboard open during the
            run, on the same machine, opened and live before the run starts: the server's side plus a browser
            drawing the page (it throttles its own redraws to ~2.5% of a core; see dashboard.js).
Rounds interleave the modes (the machine may be shared and noisy); medians and the ratio to `none`
of the same run are reported.

Then, in this process, the engine's side of it directly: the embedded model with 16 requests
decoding, the median time of one snapshot on the engine thread (LiveView.frame) and of its
encoding on the server's event loop; times the snapshot rate, that is the share of the engine's
time a watched server gives to its viewers, whatever their number.

    python benchmarks/dashboard_overhead.py --rounds 3 --json benchmarks/results/dashboard_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servescope.bench.serve_client import wait_healthy

CLI = [sys.executable, "-m", "servescope.cli"]


def _bench(url: str, a, mode: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = CLI + ["bench", "serve", "--base-url", url, "--num-prompts", str(a.num_prompts), "--input-len",
                 str(a.input_len), "--output-len", str(a.output_len), "--seed", str(a.seed), "--no-progress",
                 "--json", out]
    if mode == "feed":
        cmd.append("--dashboard")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if not a.verbose else None)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    return data["output_throughput"]


def _browser_page(url: str):
    from playwright.sync_api import sync_playwright  # optional: only the browser mode needs it

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    page.goto(url + "/dashboard")
    # a viewer who is already watching: the browser's start-up is not part of the run
    deadline = time.monotonic() + 60
    while page.evaluate("document.getElementById('conn-text').textContent") != "live":
        if time.monotonic() > deadline:
            raise SystemExit("the dashboard never went live")
        page.wait_for_timeout(100)
    page.wait_for_timeout(2000)
    return pw, browser, page


def _browser_cpu_seconds() -> float:
    """User + system CPU seconds of every Chromium process now alive (Playwright's are our children)."""
    import psutil  # optional: only the browser mode needs it

    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if "chrom" in proc.name():
                t = proc.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def snapshot_cost(model, interval_s: float = 0.25, reps: int = 50) -> dict:
    """Median seconds of LiveView.frame and of its SSE encoding, mid-load (16 requests decoding)."""
    from servescope import LLM, SamplingParams  # the engine: only for this measurement
    from servescope.engine.live_view import LiveView
    from servescope.server.internals_stream import sse

    engine = LLM(model=model).engine if model else LLM().engine
    view = LiveView(engine)
    for i in range(16):
        engine.add_request(f"r{i}", list(range(100 + i, 228 + i)), SamplingParams(max_tokens=400, ignore_eos=True))
    frame_s, encode_s = [], []
    for _ in range(reps):
        since = engine.step_records[-1].step if engine.step_records else 0
        for _ in range(3):  # a few steps between two snapshots, as under load
            engine.step()
        t0 = time.perf_counter()
        frame = view.frame(since)
        t1 = time.perf_counter()
        sse("frame", frame)
        encode_s.append(time.perf_counter() - t1)
        frame_s.append(t1 - t0)
    step_s = statistics.median(r.wall_seconds for r in list(engine.step_records)[-3 * reps:])
    f, e = statistics.median(frame_s), statistics.median(encode_s)
    return {"frame_ms": f * 1e3, "encode_ms": e * 1e3, "decode_step_ms": step_s * 1e3,
            "num_blocks": engine.cache_config.num_blocks, "snapshots_per_s": 1 / interval_s,
            "engine_share": f / interval_s, "loop_share": e / interval_s}


def run_rounds(a, modes, url, serve) -> dict:
    """The interleaved `bench serve` rounds: per mode its runs, median and ratio to `none`."""
    proc = subprocess.Popen(serve)
    results = {m: [] for m in modes}
    try:
        wait_healthy(url, proc, 900)
        _bench(url, a, "none")  # warm-up: extension, allocator, prefix cache of nothing
        for r in range(a.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                viewer = _browser_page(url) if mode == "browser" else None
                note = ""
                try:
                    cpu0, t0 = _browser_cpu_seconds() if viewer else 0.0, time.monotonic()
                    results[mode].append(_bench(url, a, mode))
                    if viewer:
                        share = (_browser_cpu_seconds() - cpu0) / (time.monotonic() - t0)
                        note = f" (the browser used {share:.2f} CPUs meanwhile)"
                finally:
                    if viewer:
                        viewer[1].close()
                        viewer[0].stop()
                print(f"round {r + 1} {mode}: {results[mode][-1]:.1f} output tok/s{note}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    base = statistics.median(results["none"]) if "none" in results else None
    summary = {m: {"runs": v, "median": statistics.median(v),
                   "ratio_to_none": None if not base else statistics.median(v) / base} for m, v in results.items()}
    for m, s in summary.items():
        ratio = "" if s["ratio_to_none"] is None else f"  ratio {s['ratio_to_none']:.3f}"
        print(f"{m:8s} median {s['median']:.1f} output tok/s{ratio}  runs {[round(x, 1) for x in s['runs']]}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="none,feed,browser")
    p.add_argument("--json", default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--no-snapshot-cost", action="store_true")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    url = f"http://127.0.0.1:{a.port}"
    serve = CLI + ["serve", "--port", str(a.port)] + (["--model", a.model] if a.model else [])
    summary = run_rounds(a, modes, url, serve) if a.rounds else {}
    cost = None if a.no_snapshot_cost else snapshot_cost(a.model)
    if cost:
        print(f"snapshot on the engine thread {cost['frame_ms']:.2f} ms, encoding {cost['encode_ms']:.2f} ms "
              f"(decode step {cost['decode_step_ms']:.1f} ms, {cost['num_blocks']} KV blocks): at "
              f"{cost['snapshots_per_s']:g} snapshots/s, {100 * cost['engine_share']:.2f}% of the engine thread, "
              f"{100 * cost['loop_share']:.2f}% of the event loop")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": summary, "snapshot_cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
