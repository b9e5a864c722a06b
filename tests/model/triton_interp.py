"""Triton kernels in tests: on a machine without CUDA they run in Triton's interpreter.

triton.jit picks the interpreter when a kernel is *defined*, so TRITON_INTERPRET must be set before
triton is imported, and a kernel module imported earlier in the session without it is re-imported.
"""

import importlib
import os
import sys

import pytest
import torch


def interpreted(*module_names: str) -> list:
    """The named kernel modules, their kernels under the interpreter when there is no CUDA (the test
    module is skipped without triton)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    mods = []
    for name in module_names:
        if not torch.cuda.is_available() and name in sys.modules:
            mods.append(importlib.reload(sys.modules[name]))
        else:
            mods.append(importlib.import_module(name))
    return mods
