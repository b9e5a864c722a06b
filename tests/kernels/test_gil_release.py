"""The CPU kernels run without the interpreter lock: while one thread is inside a kernel call, another Python
thread runs (the server's event loop beside a decode step, the 1P1D receiver thread beside the decode engine's
step). A ticker thread counts in a loop that sleeps 0.2 ms between counts (each sleep gives the lock up); a
kernel call that kept the lock would see at most a count or two go by (at its edges), one that releases it sees
the ticker run throughout."""

import threading
import time

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops


class Ticker:
    def __init__(self):
        self.count, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.count += 1
            time.sleep(0.0002)

    def __enter__(self):
        self._thread.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _ticks_during(call, repeats: int = 3) -> tuple:
    """(the most counts the ticker made during one call, that call's seconds)."""
    best = (0, 0.0)
    with Ticker() as t:
        for _ in range(repeats):
            before, t0 = t.count, time.perf_counter()
            call()
            best = max(best, (t.count - before, time.perf_counter() - t0))
    return best


def test_a_long_kernel_call_lets_other_threads_run():
    if cpu_ops.load() is None:
        pytest.skip("the CPU extension is not built here")
    torch.manual_seed(0)
    b, h, hkv, d, s, ctx = 8, 8, 2, 64, 16, 4096
    blocks = ctx // s
    kc = torch.randn(b * blocks, s, hkv, d)
    vc = torch.randn(b * blocks, s, hkv, d)
    tables = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    q, tables, lens = torch.randn(8 * b, h, d), tables.repeat(8, 1), lens.repeat(8)  # 64 rows of 4096 keys
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ticks, seconds = _ticks_during(lambda: cpu_ops.paged_decode(q, kc, vc, tables, lens, d ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert seconds > 0.02, "the call is too short to tell"
    # the ticker could count ~seconds / 0.2 ms times; a call holding the lock lets it count at most at its edges
    assert ticks > 5, f"{ticks} ticks in a {seconds * 1e3:.0f} ms kernel call: it held the interpreter lock"
