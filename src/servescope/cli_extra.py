"""Subcommands beyond generate/chat, each in its own module with `add_parsers(sub)` and `run(args)`:
cli_serve (serve), cli_bench (bench), cli_lab (explain, lab, hardware)."""

from __future__ import annotations

import importlib

_MODULES = {"serve": "servescope.cli_serve", "bench": "servescope.cli_bench",
            "explain": "servescope.cli_lab", "lab": "servescope.cli_lab", "hardware": "servescope.cli_lab"}


def add_subcommands(sub) -> None:
    seen = set()
    for mod_name in _MODULES.values():
        if mod_name in seen:
            continue
        seen.add(mod_name)
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue
        mod.add_parsers(sub)


def dispatch(a) -> int:
    return importlib.import_module(_MODULES[a.command]).run(a)
