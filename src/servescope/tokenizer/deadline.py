"""run_with_deadline: run a pure-Python function in the calling thread, interrupted after a deadline.

Chat templates are code that comes with model files; a loop in one (`range` is capped at 100,000 by
the sandbox, but loops nest) could render for minutes in a server thread. Python cannot kill a
thread, but it can raise an exception in one at its next bytecode (PyThreadState_SetAsyncExc): a
timer does that to the rendering thread when the deadline passes. C code (a huge string repeat) is
not interrupted until it returns; the sandbox's own limits bound those.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class DeadlineExceeded(BaseException):
    """Raised in the thread whose function ran past its deadline (a BaseException, so that the
    `except Exception` of the code it interrupts does not swallow it)."""


def run_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire():
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(tid), ctypes.py_object(DeadlineExceeded)
                )

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    try:
        return fn()
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["fired"]:  # fired after fn returned: take back the exception not yet delivered
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
