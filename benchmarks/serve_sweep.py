"""Latency vs throughput of our server: `bench serve --sweep` over request rates, on loopback.

Starts our OpenAI-compatible server (build_app over an AsyncEngine) in a child process, waits for
/health, runs `servescope bench serve` with Poisson arrivals at each rate, writes the JSON and the
latency-vs-throughput plot, and stops the server. Any other server can be measured the same way
with `servescope bench serve --base-url URL --sweep ...` directly.

    python benchmarks/serve_sweep.py --json benchmarks/results/serve_sweep.json \
        --plot docs/img/serve_sweep.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def serve(port: int, model, dtype: str, max_num_seqs: int) -> None:
    """Child process: our server until killed."""
    import uvicorn

    from servescope.config import EngineConfig
    from servescope.engine.async_engine import AsyncEngine
    from servescope.engine.llm_engine import LLMEngine
    from servescope.server.app import build_app

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=max_num_seqs))
    uvicorn.run(build_app(AsyncEngine(engine), model_name=model or "smollm2-135m"), host="127.0.0.1", port=port,
                log_level="warning")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--port", type=int, default=18734)
    p.add_argument("--rates", default="0.25,0.5,1,2,inf")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="64..256")
    p.add_argument("--output-len", default="32..96")
    p.add_argument("--vocab-size", default="49152", help="token ids are drawn below this (SmolLM2: 49152)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(a.port, a.model, a.dtype, a.max_num_seqs)
        return 0

    from servescope.bench.serve_client import wait_healthy  # the client side only (not in --serve)

    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(a.port), "--dtype", a.dtype,
           "--max-num-seqs", str(a.max_num_seqs)] + (["--model", a.model] if a.model else [])
    child = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{a.port}"
    try:
        wait_healthy(base, child, 600)
        from servescope.cli import main as cli_main

        args = ["bench", "serve", "--base-url", base, "--num-prompts", str(a.num_prompts),
                "--input-len", a.input_len, "--output-len", a.output_len, "--sweep", a.rates,
                "--vocab-size", a.vocab_size, "--goodput", "ttft:2000", "tpot:200"]
        if a.json:
            args += ["--json", a.json]
        if a.plot:
            args += ["--plot", a.plot]
        return cli_main(args)
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()


if __name__ == "__main__":
    sys.exit(main())
