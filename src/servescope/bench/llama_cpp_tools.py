"""llama.cpp's own tools as baselines: `llama-server` (continuous batching over `-np` slots, what
Ollama and most llama.cpp deployments run) for `servescope bench serve`, and `llama-bench` for its
single-stream prefill (pp512) and decode (tg128) rates.

They are found on PATH or in $LLAMA_CPP_BIN (a build directory's bin/). How to build them from the
llama-cpp-python sdist's vendored llama.cpp, with no network beyond pip, is in docs/BENCHMARKS.md
(BUILD_HINT below is the short form). The Python binding baseline (baselines.py) stays, labelled
one-request-at-a-time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from typing import Optional, Sequence

from servescope.bench.serve_client import wait_healthy
from servescope.errors import InvalidParameterError

logger = logging.getLogger(__name__)

ENV = "LLAMA_CPP_BIN"
BUILD_HINT = ("build llama-server and llama-bench from llama-cpp-python's sdist (docs/BENCHMARKS.md, "
              "'llama.cpp's own tools'), then put their directory on PATH or in $LLAMA_CPP_BIN")


def find_tool(name: str) -> Optional[str]:
    """The path of llama.cpp tool `name` (llama-server, llama-bench): $LLAMA_CPP_BIN first, then PATH."""
    where = os.environ.get(ENV)
    if where:
        path = os.path.join(where, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise InvalidParameterError("llama_cpp", f"{name} not found; {BUILD_HINT}")
    return path


def llama_server_command(binary: str, gguf: str, threads: int, slots: int = 8, ctx: int = 4096,
                         port: int = 8089, host: str = "127.0.0.1") -> list:
    """llama-server with `slots` parallel sequences sharing a `ctx`-token KV cache (ctx / slots each),
    continuous batching on, `threads` threads for decode and for prompt processing."""
    if slots < 1 or ctx < slots or threads < 1:
        raise InvalidParameterError("llama_cpp", "slots >= 1, ctx >= slots and threads >= 1 required")
    return [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx),
            "--cont-batching", "--host", host, "--port", str(port)]


class LlamaServer:
    """A llama-server child process for the duration of a `with` block; `base_url` once healthy."""

    def __init__(self, command: Sequence[str], startup_timeout: float = 120.0, log_path: Optional[str] = None):
        self.command = list(command)
        self.port = int(self.command[self.command.index("--port") + 1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.log_path = log_path or os.devnull
        self._proc = None
        self._log = None

    def __enter__(self) -> "LlamaServer":
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.base_url, self._proc, self.startup_timeout, "llama-server")
        except RuntimeError as e:
            self.__exit__(None, None, None)
            raise RuntimeError(f"{e} (log: {self.log_path})") from None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def llama_bench_command(binary: str, gguf: str, threads: int, prompt: int = 512, gen: int = 128,
                        reps: int = 3) -> list:
    """llama-bench's standard pair: pp<prompt> (prefill of a prompt-token batch) and tg<gen> (decode)."""
    return [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-o", "json"]


def parse_llama_bench(text: str) -> dict:
    """{"pp512": {"tokens_per_s", "stddev"}, "tg128": {...}} from `llama-bench -o json` output."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    out = {}
    for row in json.loads(text[start:]):
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        out[name] = {"tokens_per_s": float(row["avg_ts"]), "stddev": float(row.get("stddev_ts", 0.0)),
                     "threads": int(row.get("n_threads", 0)), "build": row.get("build_commit", "")}
    return out


def run_llama_bench(gguf: str, threads: int, prompt: int = 512, gen: int = 128, reps: int = 3,
                    timeout: float = 1800.0) -> dict:
    cmd = llama_bench_command(require_tool("llama-bench"), gguf, threads, prompt, gen, reps)
    logger.info("running %s", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {r.stderr[-500:]}")
    return parse_llama_bench(r.stdout)
