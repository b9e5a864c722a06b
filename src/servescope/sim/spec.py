"""What one simulated engine instance is: model shape, hardware, parallel layout, engine settings.

`InstanceSpec` is the simulator's EngineConfig: the same scheduler limits and KV cache settings (the
config/ parts, validated where they are defined), a model preset instead of weights, a hardware spec
instead of a device. `instance_spec(...)` resolves it the way engine/builder.py resolves an engine:
dtypes (auto: what the engine would pick on that hardware), KV blocks (the engine's CPU default, or
what the memory planner leaves on each GPU), max_model_len capped by the cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from servescope.analysis.cpu_isa import local_fast_bf16
from servescope.analysis.collectives import DEFAULT_LINK, LinkSpec, get_link, rank_weights_config
from servescope.analysis.hardware import HardwareSpec, get_hardware
from servescope.analysis.spec import FP8
from servescope.analysis.kv_stages import engine_group_blocks, rank0_kv_bytes_per_token, step_token_limit
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.op_counts import DTYPE_BYTES, resolve_dtypes
from servescope.analysis.presets import load_preset
from servescope.kvcache.hybrid import binding_blocks
from servescope.analysis.step_prediction import StepPredictor
from servescope.sim.step_table import StepTable
from servescope.config import ModelConfig, SchedulerConfig
from servescope.config.moe import expert_layout_problem
from servescope.config.engine import BatchingConfig, KVCacheConfig, ParallelConfig
from servescope.errors import InvalidParameterError

CPU_DEFAULT_KV_BYTES = 1 << 30  # engine/kv_sizing.py's CPU default: at most 1 GiB of KV cache
GPU_MEMORY_UTILIZATION = 0.9  # the share of a GPU's memory a planned instance uses (vLLM's default)
DEFAULT_CONTEXT_QUANTUM = 16  # tokens: one KV block of the default size


@dataclass(frozen=True)
class HostCosts:
    """The engine's host work that the cost model does not price: per output token detokenised (a model
    with a tokenizer), and per step the work between two steps (per_step_s: from a step's end as its
    StepRecord times it -- the tokens out, the record written -- to the next step's start: the outputs handed
    back, the loop that steps the engine; a TPOT counts it, a step's wall time and so its prediction do not).
    The host work per step, per layer and per scheduled sequence is the spec's (HardwareSpec.step_overhead_s /
    layer_overhead_s / seq_overhead_s), in the cost model's prediction as in the engine's StepRecords.
    Measured: per token on the tokenizer (measure/detokenise.py), between steps on the engine's own
    back-to-back steps (sim/step_table.between_steps_seconds); 0 on datasheets."""

    per_token_s: float = 0.0
    source: str = "none"
    per_step_s: float = 0.0

    def __post_init__(self):
        if self.per_token_s < 0 or self.per_step_s < 0:
            raise InvalidParameterError("host_costs", "host costs must be >= 0")


@dataclass(frozen=True)
class SpecDecodeSpec:
    """Speculative decoding as the simulator runs it: k drafts per decode, each accepted with
    probability `acceptance` until the first rejection (the verification's bonus token always comes)."""

    k: int = 0
    acceptance: float = 0.0

    def __post_init__(self):
        if not 0 <= self.k <= 16:
            raise InvalidParameterError("spec_k", f"speculative k must be in 0..16, got {self.k}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise InvalidParameterError("spec_acceptance", f"acceptance must be in [0, 1], got {self.acceptance}")


@dataclass(frozen=True)
class InstanceSpec:
    """One engine instance (TP x PP devices, or the local CPU) as the simulator builds it."""

    model: ModelConfig
    hardware: HardwareSpec
    dtypes: tuple  # (weight, kv, activation, activation bytes), as StepPredictor takes them
    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    # window -> the blocks of each group's pool where the engine keeps a table per group of layers (a hybrid:
    # analysis/kv_stages.engine_group_blocks, over the pipeline's stages as the engine sizes them); None: one table
    group_blocks: Optional[dict] = None
    max_step_tokens: int = 0  # the most one step adds to a sequence, as the engine's hybrid manager is told
    enable_prefix_caching: bool = True
    tp: int = 1
    pp: int = 1
    ep: int = 1
    micro_batches: int = 0
    link: Optional[LinkSpec] = None
    spec_decode: SpecDecodeSpec = field(default_factory=SpecDecodeSpec)
    host: HostCosts = field(default_factory=HostCosts)
    step_table: Optional[StepTable] = None  # measured / predicted step times (sim/step_table.py): replaces host
    # one-token rows' contexts are rounded to this many tokens when step predictions are memoised
    # (sim/step_time.py says what that costs); 0: every step predicted on its exact shape
    context_quantum: int = DEFAULT_CONTEXT_QUANTUM

    def __post_init__(self):
        if self.context_quantum < 0:
            raise InvalidParameterError("context_quantum", f"context_quantum must be >= 0, got {self.context_quantum}")

    @property
    def num_devices(self) -> int:
        """Devices this instance occupies (1 for the local CPU, whatever its ranks)."""
        return 1 if self.hardware.kind == "cpu" else self.tp * self.pp

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V on rank 0, as the engine's StepRecords count kv_bytes_used (not the whole model's)."""
        return rank0_kv_bytes_per_token(self.model, self.dtypes[1], self.tp, self.pp)

    def predictor(self) -> StepPredictor:
        return StepPredictor(self.model, self.hardware, self.dtypes, self.tp, self.pp, self.micro_batches,
                             self.link, self.ep)

    def replace(self, **kw) -> "InstanceSpec":
        return dataclasses.replace(self, **kw)


def resolve_dtype(dtype: str, hw: HardwareSpec) -> str:
    """auto: bfloat16 on a GPU and on a CPU with bfloat16 dot products (whose probe did not find bfloat16
    slow), float32 elsewhere -- the engine's rule (engine/builder.resolve_dtypes)."""
    if dtype != "auto":
        return dtype
    if hw.kind == "gpu":
        return "bfloat16"
    return "bfloat16" if local_fast_bf16() and "bfloat16" not in hw.slow_dtypes else "float32"


def _cpu_blocks(kv_bytes_tok: int, block_size: int, max_num_seqs: int, max_len: int, hw: HardwareSpec) -> int:
    """engine/kv_sizing.num_kv_blocks's CPU default: max_num_seqs full contexts, at most 1 GiB or a
    quarter of the memory."""
    per_block = kv_bytes_tok * block_size
    useful = per_block * max_num_seqs * -(-max_len // block_size)
    return min(CPU_DEFAULT_KV_BYTES, hw.memory_bytes // 4, useful) // per_block


def _gpu_blocks(cfg: ModelConfig, hw: HardwareSpec, wdt: str, kdt: str, adt: str, block_size: int,
                tp: int, pp: int, batching: BatchingConfig, ep: int = 1) -> int:
    """KV blocks the memory planner leaves on each GPU of a TP x PP (x EP) instance (its shard of the weights,
    its experts, its KV heads, stage 0's layers, which size the blocks as on the engine's rank 0), times nothing:
    every rank holds the same block ids."""
    plan = plan_memory(rank_weights_config(cfg, tp, ep), hw.memory_bytes, wdt, kdt, context_len=block_size,
                       block_size=block_size, act_dtype=adt, max_num_batched_tokens=batching.max_num_batched_tokens,
                       max_num_seqs=batching.max_num_seqs, memory_utilization=GPU_MEMORY_UTILIZATION, pp=pp)
    if plan.num_kv_blocks < 1:
        raise InvalidParameterError(
            "layout", f"{cfg.name} does not fit on {hw.name} at TP={tp} x PP={pp}: weights "
                      f"{plan.weight_bytes / 1e9:.1f} GB + activations per GPU leave no room for the KV cache")
    return plan.num_kv_blocks


def instance_spec(model: str | ModelConfig, hardware: str | HardwareSpec, *, dtype: str = "auto",
                  quantization: Optional[str] = None, kv_cache_dtype: str = "auto",
                  cache: KVCacheConfig = KVCacheConfig(),
                  batching: BatchingConfig = BatchingConfig(), parallel: ParallelConfig = ParallelConfig(),
                  ep: int = 1, link: "str | LinkSpec | None" = None, spec_decode: SpecDecodeSpec = SpecDecodeSpec(),
                  host: HostCosts = HostCosts(), step_table: Optional[StepTable] = None,
                  context_quantum: int = DEFAULT_CONTEXT_QUANTUM) -> InstanceSpec:
    """Resolve an instance as engine/builder.py resolves an engine (the config parts are the engine's).
    quantization: the weights' dtype or packed format where it is not the activations' (int8, fp8 on FP8
    tensor cores, int4, q4_0, ...: analysis/op_counts.resolve_dtypes; None: float weights)."""
    cfg = load_preset(model) if isinstance(model, str) else model
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    problem = expert_layout_problem(cfg.moe, tp, ep)  # the engine's rule
    if problem:
        raise InvalidParameterError("ep", problem)
    if cfg.num_attention_heads % tp or cfg.intermediate_size % tp or cfg.num_hidden_layers < pp:
        raise InvalidParameterError("layout", f"{cfg.name} cannot be split TP={tp} x PP={pp} (heads "
                                              f"{cfg.num_attention_heads}, layers {cfg.num_hidden_layers})")
    adt = resolve_dtype(dtype, hw)
    wdt = resolve_dtypes(quantization, adt)[0] if quantization else adt
    if wdt == FP8:
        hw.flops(FP8)  # (refused where the part has no FP8 tensor cores)
    kdt = adt if kv_cache_dtype == "auto" else ("fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype)
    # rank 0's bytes per token (its KV heads, stage 0's layers): what the engine sizes a byte budget by
    kv_tok = rank0_kv_bytes_per_token(cfg, kdt, tp, pp)
    max_len = batching.max_model_len or cfg.max_position_embeddings
    if cache.num_kv_blocks is not None:
        blocks = cache.num_kv_blocks
    elif cache.kv_cache_memory_bytes is not None:
        blocks = cache.kv_cache_memory_bytes // (kv_tok * cache.block_size)
    elif hw.kind == "cpu":
        blocks = _cpu_blocks(kv_tok, cache.block_size, batching.max_num_seqs, max_len, hw)
    else:
        blocks = _gpu_blocks(cfg, hw, wdt, kdt, adt, cache.block_size, tp, pp, batching, ep)
    if blocks < 1:
        raise InvalidParameterError("kv_cache", "the KV cache holds less than one block")
    chunked = batching.enable_chunked_prefill
    step_max = step_token_limit(chunked, batching.max_num_batched_tokens, max_len)
    pools = None if cache.disable_hybrid_kv_cache_manager else engine_group_blocks(
        cfg, blocks, cache.block_size, batching.max_num_seqs, 1 + spec_decode.k, step_max, pp)
    binds = blocks if pools is None else binding_blocks(pools, cache.block_size, step_max)
    if binds * cache.block_size < max_len:
        if batching.max_model_len is not None:
            raise InvalidParameterError("max_model_len", f"the KV cache holds {binds * cache.block_size} tokens, "
                                                         f"fewer than max_model_len={max_len}")
        max_len = binds * cache.block_size
    sched = SchedulerConfig(max_num_seqs=batching.max_num_seqs,
                            max_num_batched_tokens=step_token_limit(chunked, batching.max_num_batched_tokens, max_len),
                            max_model_len=max_len, enable_chunked_prefill=chunked, block_size=cache.block_size)
    link_spec = link if isinstance(link, LinkSpec) else None
    if max(tp, ep) * pp > 1 and link_spec is None and link != "none":
        if link is None and hw.kind == "cpu":
            raise InvalidParameterError("link", "ranks on the local CPU talk over gloo: pass the measured local link "
                                                "(`servescope simulate` measures it once), or a named --link")
        link_spec = get_link(link or DEFAULT_LINK.get(hw.name, "pcie4"))
    return InstanceSpec(model=cfg, hardware=hw, dtypes=(wdt, kdt, adt, DTYPE_BYTES[adt]), scheduler=sched,
                        num_blocks=int(blocks), block_size=cache.block_size, group_blocks=pools,
                        max_step_tokens=step_max,
                        enable_prefix_caching=cache.enable_prefix_caching, tp=tp, pp=pp, ep=ep,
                        micro_batches=parallel.pipeline_micro_batches, link=link_spec, spec_decode=spec_decode,
                        host=host, step_table=step_table, context_quantum=context_quantum)


def describe(spec: InstanceSpec) -> str:
    """One line: what the instance is."""
    wdt, adt, kdt = spec.dtypes[0], spec.dtypes[2], spec.dtypes[1]
    layout = (f"TP={spec.tp} x PP={spec.pp}" + (f" with EP={spec.ep}" if spec.ep > 1 else "")
              + (f" on {spec.link.name}" if spec.link else ""))
    kv_tokens = spec.num_blocks * spec.block_size
    sd = spec.spec_decode
    spec_txt = f", speculative k={sd.k} acceptance {sd.acceptance:g}" if sd.k else ""
    host = (f"step times x measured / predicted ({spec.step_table.source})" if spec.step_table else
            f"host {spec.hardware.step_overhead_s * 1e3:.2f} ms/step + "
            f"{spec.hardware.layer_overhead_s * 1e6:.0f} us/layer + "
            f"{spec.hardware.seq_overhead_s * 1e6:.0f} us/seq + {spec.host.per_token_s * 1e6:.0f} us/token "
            f"+ {spec.host.per_step_s * 1e3:.2f} ms between steps ({spec.host.source})")
    weights = "" if wdt == adt else f"{wdt} weights, "
    return (f"{spec.model.name} on {spec.hardware.name} ({layout}), {weights}{adt} (KV {kdt}), KV cache "
            f"{spec.num_blocks} blocks = {kv_tokens} tokens{_pools(spec.group_blocks)}, "
            f"max_num_seqs {spec.scheduler.max_num_seqs}, token budget "
            f"{spec.scheduler.max_num_batched_tokens}"
            f"{'' if spec.scheduler.enable_chunked_prefill else ' (no chunking)'}, "
            f"prefix caching {'on' if spec.enable_prefix_caching else 'off'}{spec_txt}; {host}")


def _pools(pools: Optional[dict]) -> str:
    """A hybrid's pools per group of layers (the engine's table per group), or nothing with one table."""
    if not pools:
        return ""
    return " (pools: " + ", ".join(f"{'full' if not w else f'window {w}'} {n}" for w, n in sorted(pools.items())) + ")"
