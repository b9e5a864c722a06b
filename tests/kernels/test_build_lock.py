"""A build killed mid-way must not hang every later one: torch's build `lock` file outlives a killed
builder and torch waits on it forever (this hung an install). The extension's build holds an flock,
which the OS releases when its holder dies, and clears a `lock` it finds under it."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from servescope.kernels.cpu import ops as cpu_ops
from servescope.kernels.cpu.extension import build_lock

HOLDER = textwrap.dedent("""
    import os, sys, time
    from servescope.kernels.cpu.extension import build_lock
    with build_lock(sys.argv[1]):
        open(os.path.join(sys.argv[1], "lock"), "w").close()  # torch's baton, as a builder leaves it
        print("holding", flush=True)
        time.sleep(600)
""")


def test_a_killed_builders_lock_is_cleared_and_a_live_one_waited_for(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with open(tmp_path / "servescope-build.flock", "w") as probe:
            with pytest.raises(BlockingIOError):  # the live builder is waited for, its lock left alone
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "lock").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t0 = time.monotonic()
    with build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - t0 < 30


def test_the_extension_loads_past_a_stale_torch_lock(tmp_path):
    if cpu_ops.kernel_path() == "eager PyTorch":
        pytest.skip("the CPU extension does not build here")
    built = os.path.dirname(cpu_ops._EXT.mod.__file__)
    copy = tmp_path / os.path.basename(built)
    shutil.copytree(built, copy)  # mtimes kept: ninja finds it up to date, nothing compiles
    (copy / "lock").touch()
    code = "from servescope.kernels.cpu import ops; print(ops.kernel_path())"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "C++ kernels" in out.stdout and not (copy / "lock").exists()


def test_each_checkout_builds_in_a_directory_of_its_own(tmp_path):
    """Two checkouts loading in turn must not share torch's build directory: its build file names the sources
    by path, so each would rebuild over the other's every time."""
    from servescope.kernels.cpu.extension import checkout_tag

    a, b = tmp_path / "a" / "csrc" / "ops.cpp", tmp_path / "b" / "csrc" / "ops.cpp"
    assert checkout_tag(str(a)) != checkout_tag(str(b))
    assert checkout_tag(str(a)) == checkout_tag(str(a.parent / "other.cpp"))  # one tag per checkout's csrc
    assert len(checkout_tag(str(a))) == 8
