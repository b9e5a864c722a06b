"""The caching allocator for torch's large CPU tensors (kernels/cpu/csrc/host_cache.cpp): a freed block of 1 MiB
or more is handed to the next tensor of its size class, from any thread; small tensors are not its business;
past its limit blocks go back to the OS; an engine on the CPU installs it. And the KV cache's own mapping
(model/attention/kv_quant.allocate): its pages are not touched at start-up, whatever the allocator."""

from __future__ import annotations

import resource
import threading

import pytest
import torch

from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.attention import kv_quant

needs_ext = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")
MIB = 1 << 20


@pytest.fixture
def cache():
    # an empty cache to start from (a limit of 0 gives every kept block back): a block of a test's size class that
    # earlier tests freed would serve its first tensor without a page fault (the MoE tests before this module did)
    assert cpu_ops.cache_host_memory(0)
    assert cpu_ops.cache_host_memory()
    yield cpu_ops.host_cache_stats
    cpu_ops.cache_host_memory()  # the default limit again


@needs_ext
def test_a_freed_block_serves_the_next_tensor_of_its_size_class(cache):
    before = cache()
    x = torch.empty(3 * MIB // 4, dtype=torch.float32)  # 3 MiB
    ptr = x.data_ptr()
    other = torch.empty(3 * MIB // 4)  # live beside it: another block
    assert other.data_ptr() != ptr
    del x
    y = torch.empty((3 * MIB - 4096) // 4)  # a little smaller: the same class (2.875-3 MiB round up to 3 MiB)
    assert y.data_ptr() == ptr
    y.fill_(2.0)
    assert float(y.sum()) == 2.0 * y.numel()
    after = cache()
    assert after["installed"] == 1 and after["hits"] >= before["hits"] + 1
    del y, other


@needs_ext
def test_another_thread_reuses_its_blocks_without_faulting_pages_in(cache):
    """The server's engine runs in a thread of its own: there glibc hands a freed aligned block back to the
    OS with its heap, and the next step faults every page in again."""
    faults = []

    def churn():
        for _ in range(3):
            t = torch.empty(32 * MIB // 4)
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t[::1024].fill_(1.0)  # one float per 4 KiB page: every page, in this thread
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
            del t

    th = threading.Thread(target=churn)
    th.start()
    th.join()
    pages = 32 * MIB // 4096
    assert faults[0] >= pages // 2  # the first pass maps the block (a test that can see a fault)
    assert max(faults[1:]) < pages // 16, faults


@needs_ext
def test_small_tensors_are_not_cached(cache):
    before = cache()
    for _ in range(5):
        torch.empty(MIB // 4 - 16)  # just under 1 MiB
    after = cache()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


@needs_ext
def test_past_its_limit_a_freed_block_goes_back_to_the_os(cache):
    torch.empty(2 * MIB)  # 8 MiB freed into the cache
    assert cache()["cached_bytes"] >= 8 * MIB
    cpu_ops.cache_host_memory(0)  # a lowered limit frees what it kept
    assert cache()["cached_bytes"] == 0
    dropped = cache()["dropped"]
    torch.empty(2 * MIB)
    after = cache()
    assert after["cached_bytes"] == 0 and after["dropped"] == dropped + 1 and after["in_use_bytes"] >= 0


@needs_ext
def test_a_full_cache_gives_its_oldest_blocks_back_for_a_new_one(cache):
    """A cache filled with another workload's sizes must not turn the current step's blocks away (found in the full
    suite: earlier tests had left the cache full, and the thread above faulted every page again)."""
    cpu_ops.cache_host_memory(64 * MIB)
    for mib in range(5, 13):  # 5..12 MiB, eight distinct classes, 68 MiB freed in all: the cache full
        torch.empty(mib * MIB // 4)
    full = cache()
    assert 64 * MIB - 12 * MIB < full["cached_bytes"] <= 64 * MIB
    torch.empty(20 * MIB // 4)  # freed: takes the room of the oldest
    kept = cache()
    assert kept["cached_bytes"] <= 64 * MIB and kept["dropped"] > full["dropped"]
    torch.empty(20 * MIB // 4)  # served by the block just freed
    assert cache()["hits"] == kept["hits"] + 1


@needs_ext
def test_a_cpu_engine_installs_it(smollm2_llm):
    assert cpu_ops.host_cache_stats()["installed"] == 1


def test_the_kv_cache_is_mapped_lazily_and_reads_as_zeros():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache = kv_quant.allocate(512, 16, 8, 64, torch.float32, torch.device("cpu"))  # 16 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0 < 512  # 4096 pages, none touched
    assert cache.data_ptr() % 4096 == 0 and cache.shape == (512, 16, 8, 64)
    assert not cache[::37].any()
    cache[3, 5] = 1.0  # writable
    assert float(cache.sum()) == 8 * 64
    q = kv_quant.allocate(4, 16, 2, 64, torch.int8, torch.device("cpu"))
    assert q.shape == (4, 16, 2, 68) and q.dtype == torch.int8 and not q.any()
