"""Packed weights moved onto huge pages (model/quantize.py's quantize_model calls it last): decode reads
every packed byte once per token, and each 4 KiB page is a TLB entry."""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def move_to_huge_pages(modules) -> int:
    """Copy the packed weights and scales of `modules` (QuantLinear / QuantEmbedding, in the order the
    decode step reads them) into one anonymous mapping advised MADV_HUGEPAGE, and point the modules at
    views of it. Decode streams these bytes once per token, and on 4 KiB pages each 4 KiB is a new TLB
    entry; 2 MiB pages (Linux's transparent huge pages, granted to a mapping that asks where THP is
    `madvise` or `always`) take 512x fewer (the effect on decode speed is not yet measured on a quiet
    machine: docs/BENCHMARKS.md, issue 15). A buffer shared by two modules (a tied GGUF embedding and
    head) stays shared. Returns the bytes moved: 0 off the CPU, where the OS has no
    MADV_HUGEPAGE, or with nothing to move."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    def key(t):  # the same tensor (a shared buffer), not merely the same first byte
        return t.data_ptr(), t.dtype, tuple(t.shape)

    found = {}  # key -> tensor, first use first
    for mod in modules:
        for name in ("qweight", "scales"):
            t = getattr(mod, name)
            if t.device.type == "cpu" and t.is_contiguous() and t.numel():
                found.setdefault(key(t), t)
    if advice is None or not found:
        return 0
    offsets, size = {}, 0
    for ptr, t in found.items():
        offsets[ptr] = size
        size += -(-t.numel() * t.element_size() // 64) * 64
    # private: a shared anonymous mapping is shmem, whose huge pages follow another setting (often off)
    # whole huge pages from an aligned start (the unaligned head of the mapping is never touched)
    arena = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(advice)
    flat = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive as long as any view
    start = -flat.data_ptr() % HUGE_PAGE  # the weights begin on a huge-page boundary
    moved = {}
    for ptr, t in found.items():
        nbytes = t.numel() * t.element_size()
        view = flat[start + offsets[ptr]:start + offsets[ptr] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        moved[ptr] = view
    for mod in modules:
        for name in ("qweight", "scales"):
            t = getattr(mod, name)
            if key(t) in moved:
                setattr(mod, name, moved[key(t)])
    return size
