"""The picture of docs/dashboard.png: the dashboard of the embedded model at a busy moment.

Starts `servescope serve` with a KV cache small enough that requests queue, sends chat requests that
share a system prompt (their first blocks are one cached prefix) from a few concurrent clients, and
photographs /dashboard in headless Chromium a while into the load.

    python benchmarks/dashboard_screenshot.py --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from servescope.bench.serve_client import wait_healthy

SYSTEM = ("You are a patient teacher. Explain things to a curious twelve-year-old in plain words, with one "
          "everyday example, and keep every answer short.")
QUESTIONS = ["Why is the sky blue?", "How does a fridge keep food cold?", "What is a black hole?",
             "Why do we have seasons?", "How do airplanes stay in the air?", "What makes a rainbow?",
             "How does the heart pump blood?", "Why does ice float on water?", "What is electricity?",
             "How do plants make food from sunlight?", "Why do cats purr?", "What is an echo?",
             "How do vaccines work?", "Why is the sea salty?", "What causes thunder?", "How do magnets work?"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--after", type=float, default=25.0, help="seconds into the load (default 25)")
    p.add_argument("--clients", type=int, default=10)
    a = p.parse_args(argv)
    url = f"http://127.0.0.1:{a.port}"
    proc = subprocess.Popen([sys.executable, "-m", "servescope.cli", "serve", "--port", str(a.port),
                             "--kv-cache-memory", str(160 * 2**20), "--max-num-seqs", "8"], stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, 600)

        def ask(i: int) -> None:
            try:
                _post(i)
            except httpx.HTTPError:  # the server goes away under the last requests: expected
                pass

        def _post(i: int) -> None:
            httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": "smollm2-135m", "temperature": 0.7, "seed": i, "max_tokens": 64 + 32 * (i % 4),
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]})

        from playwright.sync_api import sync_playwright  # optional: this script needs it

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1200}, device_scale_factor=1)
            page.goto(url + "/dashboard")
            load = threading.Thread(target=lambda: list(ThreadPoolExecutor(a.clients).map(ask, range(48))),
                                    daemon=True)
            load.start()
            time.sleep(a.after)
            page.screenshot(path=a.out, full_page=True)
            print(f"screenshot written to {a.out}")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
