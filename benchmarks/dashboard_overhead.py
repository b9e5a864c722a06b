"""Server throughput with and without the dashboard open: the cost of watching.

Starts `servescope serve` (the embedded model unless --model) and runs the same `servescope bench
serve` load in interleaved rounds, three ways:
  none      nobody watches;
  feed      `bench serve --dashboard`: a headless reader of /v1/internals/stream (the server's side
            of the cost: the snapshots and their encoding);
  browser   a headless Chromium (Playwright, the system chromium) with /dashboard open during the
            run, on the same machine: the server's side plus a browser drawing 4 times a second.
Rounds interleave the modes (the machine may be shared and noisy); medians and the ratio to `none`
of the same run are reported.

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

import httpx

CLI = [sys.executable, "-m", "servescope.cli"]


def _wait_up(url: str, proc, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not come up")


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
    return pw, browser, page


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
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    url = f"http://127.0.0.1:{a.port}"
    serve = CLI + ["serve", "--port", str(a.port)] + (["--model", a.model] if a.model else [])
    proc = subprocess.Popen(serve)
    results = {m: [] for m in modes}
    try:
        _wait_up(url, proc)
        _bench(url, a, "none")  # warm-up: extension, allocator, prefix cache of nothing
        for r in range(a.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                viewer = _browser_page(url) if mode == "browser" else None
                try:
                    results[mode].append(_bench(url, a, mode))
                finally:
                    if viewer:
                        viewer[1].close()
                        viewer[0].stop()
                print(f"round {r + 1} {mode}: {results[mode][-1]:.1f} output tok/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    base = statistics.median(results["none"]) if "none" in results else None
    summary = {m: {"runs": v, "median": statistics.median(v),
                   "ratio_to_none": None if not base else statistics.median(v) / base} for m, v in results.items()}
    for m, s in summary.items():
        ratio = "" if s["ratio_to_none"] is None else f"  ratio {s['ratio_to_none']:.3f}"
        print(f"{m:8s} median {s['median']:.1f} output tok/s{ratio}  runs {[round(x, 1) for x in s['runs']]}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
