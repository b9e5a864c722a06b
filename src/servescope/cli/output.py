"""What the commands print with: the console, the one-line error, JSON files and number formats.

The CLI owns all output (rich tables, progress bars); library code only logs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from servescope.cli.args import EXIT_USAGE


def console(highlight: bool = True):
    # rich is imported here, not at the top: it is 0.13 s of `servescope --help`'s 0.1 s without it
    from rich.console import Console

    return Console(highlight=highlight)


def error(message: str) -> int:
    """Print `servescope: error: MESSAGE` on stderr; return the usage exit code (2)."""
    sys.stderr.write(f"servescope: error: {message}\n")
    return EXIT_USAGE


def write_json(path, data) -> None:
    """`data` as indented JSON in the file `path` (its folder made); what JSON cannot hold as its str."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def fmt(x, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """x * scale with `digits` decimals and a unit; '-' for a missing figure."""
    return "-" if x is None else f"{x * scale:.{digits}f}{unit}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
