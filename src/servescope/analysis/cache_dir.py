"""Where servescope keeps what it measured on this machine ($XDG_CACHE_HOME/servescope, else ~/.cache/servescope):
the probe's spec, the bandwidth history, the measured links."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "servescope"
