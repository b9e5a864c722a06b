"""servescope command line: generate | chat | serve | bench | replay | simulate | explain | lab | hardware |
quantize | checkpoint.

The CLI parses, calls the library and renders; what a command computes lives below it (engine,
bench, labs, analysis). The CLI owns all output (rich tables, progress bars); library code only logs.
Bad arguments print one clear line and exit with code 2, never a traceback.

Start-up: `servescope --help` builds every command's parser, so the command modules import only
argparse and the torch-free layers at their top; torch, transformers, the engine, servescope.bench
(numpy, httpx), matplotlib and rich are imported inside the functions that run a command. That keeps
`--help` and argument errors at 0.1 s instead of 0.7 s (2 s and more with the engine).
"""

from __future__ import annotations

import argparse
import logging

from servescope.cli import bench, checkpoint, generate, lab, quantize, replay, serve, simulate
from servescope.cli.args import EXIT_USAGE, Parser
from servescope.cli.output import error
from servescope.errors import ServescopeError

# command -> the module that parses and runs it. A module's add_parser(sub) adds the parsers of all
# the commands it runs (called once per module, in this order, which is the order of `--help`);
# its run(args) runs args.command and returns the exit code.
COMMANDS = {
    "generate": generate, "chat": generate,
    "serve": serve,
    "bench": bench,
    "replay": replay,
    "simulate": simulate,
    "explain": lab, "lab": lab, "hardware": lab,
    "quantize": quantize,
    "checkpoint": checkpoint,
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="servescope", description="An LLM inference engine that shows its work.")
    p.add_argument("-v", "--verbose", action="count", default=0)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(a.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if a.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return COMMANDS[a.command].run(a)
    except ServescopeError as e:
        return error(str(e))
    except KeyboardInterrupt:
        return 130
