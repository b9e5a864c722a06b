"""Compile a test module's check binaries side by side: each g++ run is one thread of work, and a
module's 4-7 of them one after another left every other core idle for most of a minute."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


def compile_check(cmd: list) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stderr[-3000:]}"


def build_all(jobs: dict, out_dir: Path):
    """jobs: {name: command line without its "-o OUT"}; yields {name: Future of the binary's path} while the
    builds run on up to one thread per CPU (a test waits only for its own), and waits for all at the end."""
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else os.cpu_count() or 1))

    def build(name: str, cmd: list) -> Path:
        exe = out_dir / name
        compile_check([*cmd, "-o", exe])
        return exe

    with ThreadPoolExecutor(workers) as pool:
        futures: dict[str, Future] = {name: pool.submit(build, name, cmd) for name, cmd in jobs.items()}
        yield futures
