"""Writing a model directory all or nothing (`servescope quantize`, `servescope checkpoint`): the
destination is checked before any work, the files are written into a temporary directory beside it and
renamed into place at the end, and a failure (or Ctrl-C) leaves nothing behind, not even the parent
directories this created."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from servescope.errors import InvalidParameterError


def check_destination(out: str) -> str:
    """The absolute destination; InvalidParameterError where it exists and is not an empty directory, or
    where the nearest existing parent cannot be written."""
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise InvalidParameterError("out", f"{out} exists and is not an empty directory; "
                                    "choose another --out")
    probe = os.path.dirname(out)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidParameterError("out", f"cannot write {out}: {probe} is not a writable directory")
    return out


@contextlib.contextmanager
def atomic_directory(out: str, prefix: str):
    """Yield a temporary directory beside `out` (checked as above); on a clean exit it becomes `out`."""
    out = check_destination(out)
    created, p = None, os.path.dirname(out)  # the topmost parent that does not exist yet
    while not os.path.exists(p):
        created, p = p, os.path.dirname(p)
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(out))
    except OSError as e:
        _remove(created)
        raise InvalidParameterError("out", f"cannot write {out}: {e.strerror}") from None
    try:
        os.chmod(tmp, 0o755)  # (mkdtemp's is 0o700: the result is as readable as any other model)
        yield tmp
        if os.path.isdir(out):
            os.rmdir(out)  # (empty, checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove(created)
        raise


def _remove(top) -> None:
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)
