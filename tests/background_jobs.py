"""Self-contained subprocess work of a test module, run while the tests before it run.

Compiling the C++ check programs for every ISA and running them (some under qemu), or compiling every
Triton kernel for sm_90, is a minute or more of CPU in processes that need nothing from the session.
Most tests keep one core busy (Python) and leave the other idle, so a module registers that work here
at import (`register`), tests/conftest.py starts the jobs of the modules the session selected once
collection ends and runs those modules after all the others, and a test takes its job's result
(`result`) and checks it as it would have checked its own subprocess. The commands are the ones the
test ran itself; only when they run changes.

Jobs run niced (the tests running meanwhile keep their cores), on one thread per CPU. A job's commands
run in order, each only if the one before it succeeded. Time limits count from the moment a test asks
for the result: before that a job may wait behind busy tests for as long as they take.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

NICE = 10  # a tenth of a core's share against a busy test at nice 0, all of an idle one


@dataclass
class Command:
    argv: list
    env: dict | None = None
    cwd: str | None = None


@dataclass
class _Job:
    commands: list
    owner: str  # the registering module's __name__
    future: Future | None = None
    procs: list = field(default_factory=list)
    cancelled: bool = False


_jobs: dict[str, _Job] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_workdir: str | None = None


def workdir() -> Path:
    """A directory for the jobs' outputs (binaries), removed when the session ends."""
    global _workdir
    with _lock:
        if _workdir is None:
            _workdir = tempfile.mkdtemp(prefix="servescope-tests-")
    return Path(_workdir)


def register(name: str, commands: list, owner: str) -> str:
    """Declare job `name` (Command or argv lists, run in order) of module `owner`; nothing runs yet."""
    cmds = [c if isinstance(c, Command) else Command(list(c)) for c in commands]
    with _lock:
        if name in _jobs and _jobs[name].future is not None:
            raise RuntimeError(f"background job {name!r} registered twice")
        _jobs[name] = _Job(cmds, owner)
    return name


def owners() -> set:
    """The __name__ of every module that registered a job."""
    with _lock:
        return {job.owner for job in _jobs.values()}


def _prefix() -> list:
    nice = shutil.which("nice")
    return [nice, "-n", str(NICE)] if nice else []


def _run(job: _Job) -> list:
    done = []
    for cmd in job.commands:
        if job.cancelled:
            raise RuntimeError("cancelled")
        proc = subprocess.Popen([*_prefix(), *map(str, cmd.argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=cmd.env, cwd=cmd.cwd)
        job.procs.append(proc)
        out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(cmd.argv, proc.returncode, out, err))
        if proc.returncode != 0:
            break
    return done


def start(owners: list) -> None:
    """Start the registered jobs of the modules named in `owners` not started yet: module by module in
    that order (the order their tests run in), each module's in the order it registered them."""
    global _pool
    with _lock:
        todo = [j for owner in dict.fromkeys(owners) for j in _jobs.values() if j.owner == owner and j.future is None]
        if not todo:
            return
        if _pool is None:
            _pool = ThreadPoolExecutor(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                       else os.cpu_count() or 1, thread_name_prefix="background-job")
        for job in todo:
            job.future = _pool.submit(_run, job)


def result(name: str, timeout: float = 600) -> list:
    """The CompletedProcess of each command job `name` ran (it stops after the first that failed),
    waiting up to `timeout` seconds from now; started here if the session did not start it."""
    job = _jobs[name]
    if job.future is None:
        start([job.owner])
    try:
        return job.future.result(timeout=timeout)
    except TimeoutError:
        _kill(job)
        raise AssertionError(f"background job {name!r} did not finish within {timeout:.0f} s of being waited "
                             f"for: {[c.argv for c in job.commands]}") from None


def _kill(job: _Job) -> None:
    job.cancelled = True
    if job.future is not None:
        job.future.cancel()
    for p in job.procs:
        if p.poll() is None:
            p.kill()


def stop() -> None:
    """End every job (those no test waited for included) and remove the work directory."""
    global _pool, _workdir
    for job in list(_jobs.values()):
        _kill(job)
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    if _workdir is not None:
        shutil.rmtree(_workdir, ignore_errors=True)
        _workdir = None
