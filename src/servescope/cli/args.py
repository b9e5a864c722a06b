"""The parser class and the arguments several commands share: number types, the engine's options
(generate, chat, serve, bench) and the sampling options (generate, chat).

Bad arguments print one line on stderr and exit with code 2, never the usage or a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys

from servescope.config import KV_CACHE_DTYPES, EngineConfig, SamplingParams, SpeculativeConfig
from servescope.errors import EngineConfigError

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too; users want the reason)
        sys.stderr.write(f"servescope: error: {message}\n")
        sys.exit(EXIT_USAGE)


def _number(s: str, what: str = "a number") -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def nonneg_float(s: str) -> float:
    v = _number(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_float(s: str) -> float:
    """A finite number > 0."""
    v = _number(s)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s!r}")
    return v


def request_rate(s: str) -> float:
    """Requests/s > 0; 'inf' sends every request at once."""
    v = _number(s, "a number of requests/s or 'inf'")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {s!r}")
    return v


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate, chat, serve and bench."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf file, 'smollm2-135m' (default, the embedded model) or random:PRESET")
    g.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"],
                   help="auto (default): bfloat16 on a GPU and on a CPU with bfloat16 dot products "
                        "(AVX512-BF16, AMX, ARM BF16), float32 elsewhere")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--kv-cache-memory", type=positive_int, default=None, metavar="BYTES",
                   help="KV cache size in bytes")
    g.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F",
                   help="KV cache as a fraction of free memory")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto (the model dtype), a float dtype, or int8 / fp8 (= fp8_e4m3): quantised per "
                        "token and KV head when written, read by the attention kernels as it is")
    g.add_argument("--max-num-seqs", type=positive_int, default=64)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=1024)
    g.add_argument("--max-model-len", type=positive_int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step (baseline)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for all layers even where they mix attention windows (Gemma 2/3, gpt-oss)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--gpu-linear", default="cublas", choices=["cublas", "triton", "auto"],
                   help="decode matmuls on a GPU: cuBLAS, the Triton GEMV, or the faster of the two per "
                        "shape, timed at start-up")
    g.add_argument("--quantization", default=None,
                   help="weight-only: gguf (a .gguf's own Q4_0/Q4_1/Q8_0 blocks), int8 (per channel), "
                        "int4 (group 32, symmetric) or "
                        "int<4|8>-<g32|g64|g128|ch>[-sym|-asym], e.g. int4-g128-asym; weights stay packed")
    g.add_argument("--threads", type=positive_int, default=None)
    g.add_argument("--hardware", default=None, help="hardware spec for step predictions (default: probe / GPU)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="ngram: prompt lookup; draft: a draft model sharing the vocabulary (--draft-model)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts per step and request (default 4 when a method is given)")
    s.add_argument("--draft-model", default=None, metavar="PATH",
                   help="the draft (default: the target's own weights, see --draft-quantization)")
    s.add_argument("--draft-quantization", default=None, metavar="MODE",
                   help="the draft's weights: int4, int8 (or any --quantization mode); self-speculation "
                        "with the target's own weights quantised")
    s.add_argument("--prompt-lookup-min", type=positive_int, default=1)
    s.add_argument("--prompt-lookup-max", type=positive_int, default=4)
    s.add_argument("--no-adaptive-speculation", action="store_true",
                   help="always propose K tokens (default: k per request from its acceptance rate and the "
                        "cost model, 0 where speculation would slow the batch down)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="T",
                   help="shard each layer over T processes (gloo on the CPU, NCCL on GPUs)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1, metavar="P",
                   help="split the layers into P stages, one process each (x T)")
    g.add_argument("--expert-parallel-size", "-ep", type=positive_int, default=1, metavar="X",
                   help="a mixture of experts: split its routed experts over X processes, tokens sent to them by "
                        "all-to-all (X = T, or with T = 1 over X processes of replicated attention)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM's spelling: the experts split over the tensor-parallel ranks (-ep T)")
    g.add_argument("--pipeline-micro-batches", type=int, default=0, metavar="M",
                   help="cut each pipeline step into M micro-batches so that the stages overlap "
                        "(0: auto, P for a step with enough prefill tokens; 1: stages one after another)")
    g.add_argument("--distributed-timeout", type=positive_float, default=60.0, metavar="S",
                   help="a parallel worker that does not answer within S seconds fails the engine")
    g.add_argument("--distributed-backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="torch.distributed backend (auto: gloo on the CPU, NCCL on CUDA)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
        kv_cache_memory_bytes=a.kv_cache_memory, kv_cache_memory_fraction=a.kv_cache_fraction,
        kv_cache_dtype=a.kv_cache_dtype,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=not a.no_prefix_caching,
        enable_chunked_prefill=not a.no_chunked_prefill, no_kv_cache=a.no_kv_cache,
        disable_hybrid_kv_cache_manager=a.disable_hybrid_kv_cache_manager,
        attention_backend=a.attention_backend, gpu_linear=a.gpu_linear, quantization=a.quantization,
        num_threads=a.threads, hardware=a.hardware, speculative=speculative_config_from_args(a),
        tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
        expert_parallel_size=expert_parallel_size(a),
        distributed_timeout_s=a.distributed_timeout, distributed_backend=a.distributed_backend,
        pipeline_micro_batches=a.pipeline_micro_batches)


def expert_parallel_size(a: argparse.Namespace) -> int:
    """-ep X, or --enable-expert-parallel: X = T (vLLM's rule, where EP is TP x DP and DP is 1 here)."""
    if not a.enable_expert_parallel:
        return a.expert_parallel_size
    if a.expert_parallel_size not in (1, a.tensor_parallel_size) or a.tensor_parallel_size == 1:
        raise EngineConfigError("--enable-expert-parallel splits the experts over the -tp ranks: give -tp T > 1 "
                         "(or -ep X alone)")
    return a.tensor_parallel_size


def speculative_config_from_args(a: argparse.Namespace) -> SpeculativeConfig:
    k = a.num_speculative_tokens
    if a.speculative_method is None:
        k = 0 if k is None else k  # a K without a method is rejected by SpeculativeConfig
    return SpeculativeConfig(speculative_method=a.speculative_method, speculative_model=a.draft_model,
                             num_speculative_tokens=4 if k is None else k,
                             prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
                             speculative_quantization=a.draft_quantization,
                             speculative_adaptive=not a.no_adaptive_speculation)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=max_tokens)
    g.add_argument("--temperature", type=nonneg_float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
