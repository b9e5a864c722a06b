"""servescope command line: generate | chat | serve | bench | explain | lab | hardware.

The CLI owns all output (rich tables, progress bars); library code only logs.
Bad arguments print one clear line and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too; users want the reason)
        sys.stderr.write(f"servescope: error: {message}\n")
        sys.exit(EXIT_USAGE)


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate, chat, serve, bench and lab."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf file, 'smollm2-135m' (default, the embedded model) or random:PRESET")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    g.add_argument("--block-size", type=_positive_int, default=16)
    g.add_argument("--kv-cache-memory", type=_positive_int, default=None, metavar="BYTES",
                   help="KV cache size in bytes")
    g.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F",
                   help="KV cache as a fraction of free memory")
    g.add_argument("--max-num-seqs", type=_positive_int, default=64)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=1024)
    g.add_argument("--max-model-len", type=_positive_int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step (baseline)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--gpu-linear", default="cublas", choices=["cublas", "triton", "auto"],
                   help="decode matmuls on a GPU: cuBLAS, the Triton GEMV, or the faster of the two per "
                        "shape, timed at start-up")
    g.add_argument("--quantization", default=None, choices=["int8"])
    g.add_argument("--threads", type=_positive_int, default=None)
    g.add_argument("--hardware", default=None, help="hardware spec for step predictions (default: probe / GPU)")


def engine_config_from_args(a):
    from servescope.config import EngineConfig

    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
        kv_cache_memory_bytes=a.kv_cache_memory, kv_cache_memory_fraction=a.kv_cache_fraction,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=not a.no_prefix_caching,
        enable_chunked_prefill=not a.no_chunked_prefill, no_kv_cache=a.no_kv_cache,
        attention_backend=a.attention_backend, gpu_linear=a.gpu_linear, quantization=a.quantization, num_threads=a.threads,
        hardware=a.hardware)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=_positive_int, default=max_tokens)
    g.add_argument("--temperature", type=_nonneg_float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(a):
    from servescope.config import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="servescope", description="An LLM inference engine that shows its work.")
    p.add_argument("-v", "--verbose", action="count", default=0)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for a prompt and show the internals")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (Perfetto) of the steps")
    g.add_argument("--steps", action="store_true", help="print every step record")
    add_engine_args(g)
    add_sampling_args(g)

    c = sub.add_parser("chat", help="interactive chat with the model")
    c.add_argument("--system", default=None)
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)

    from servescope import cli_extra

    cli_extra.add_subcommands(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(a.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    if a.command is None:
        parser.print_help()
        return EXIT_USAGE
    from servescope.errors import ServescopeError

    try:
        if a.command == "generate":
            from servescope.cli_generate import run_generate

            return run_generate(a)
        if a.command == "chat":
            from servescope.cli_generate import run_chat

            return run_chat(a)
        from servescope import cli_extra

        return cli_extra.dispatch(a)
    except ServescopeError as e:
        sys.stderr.write(f"servescope: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
