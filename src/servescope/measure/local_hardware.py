"""The hardware spec to build an engine with, and the full probe of the local CPU.

analysis/ is pure: its probe measures what any torch program can (bandwidth, matmul peaks) and takes
the engine-specific measurements (host overhead per step and layer, the linear and attention kernels'
rates) as arguments. This module, above the engine, hands them in. Everything above the engine (CLI,
server, labs, bench) resolves the spec here and passes it to the engine it builds; the engine alone
only reads what this measured (engine/hardware.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from servescope.analysis.collectives import LinkSpec, cached_local_link, kv_send_key, save_local_link
from servescope.analysis.hardware import LOCAL_CPU, HardwareSpec, canonical_hardware_name
from servescope.analysis.link_fit import fit_step_collectives
from servescope.analysis.probe import EngineMeasurers, probe_local_hardware
from servescope.config import EngineConfig
from servescope.engine.hardware import default_hardware, kernel_routes, local_link_key
from servescope.engine.llm_engine import LLMEngine
from servescope.kernels.cpu import ops as cpu_ops
from servescope.measure.kernel_rates import (measure_decode_attention_flops, measure_linear_rates,
                                             measure_packed_gemm_flops)
from servescope.measure.overhead import measure_host_overhead
from servescope.measure.kernel_cache import kernel_table_for
from servescope.measure.kv_send import fit_kv_send, measure_kv_send
from servescope.parallel.link_probe import fit_local_link, measure_all_reduce, measure_step_collectives

logger = logging.getLogger(__name__)

# The full probe's engine measurements (analysis/probe.py caches a spec under the full key only
# when all of them were handed in).
ENGINE_MEASURERS = EngineMeasurers(host_overhead=measure_host_overhead, linear_rates=measure_linear_rates,
                                   decode_attention_flops=measure_decode_attention_flops,
                                   packed_gemm_flops=measure_packed_gemm_flops)


def probe_local_cpu(force: bool = False, **probe_options) -> HardwareSpec:
    """The local CPU's spec: measured once (bandwidth, matmul peaks, the engine's kernel rates and host
    overhead), then read from the cache. probe_options: probe_local_hardware's sizes and cache path
    (tests run a tiny probe)."""
    return probe_local_hardware(force=force, measurers=ENGINE_MEASURERS, **kernel_routes(), **probe_options)


def resolve_hardware(name: Optional[str]) -> HardwareSpec:
    """A spec by name; "local-cpu" (and its aliases) through probe_local_cpu."""
    if canonical_hardware_name(name) == LOCAL_CPU:
        return probe_local_cpu()
    return default_hardware(torch.device("cpu"), name)


def hardware_for_device(device: torch.device, name: Optional[str] = None) -> HardwareSpec:
    """The spec to predict with: the named one, else the GPU's datasheet, else the full CPU probe."""
    if name:
        return resolve_hardware(name)
    if device.type == "cuda":
        return default_hardware(device)
    return probe_local_cpu()


def hardware_for_config(config: EngineConfig) -> Optional[HardwareSpec]:
    """What an engine of `config` predicts its steps on (None when it predicts nothing): resolved before
    the engine is built, and handed to it."""
    if not config.telemetry.predict_step_cost:
        return None
    return hardware_for_device(torch.device(config.load.device), config.telemetry.hardware)


def measured_engine(config: EngineConfig) -> LLMEngine:
    """An engine of `config` predicting its steps on the spec hardware_for_config resolves (the full
    probe on a CPU, measured once per machine), with its kernels timed at its model's shapes
    (with_kernel_table)."""
    return with_kernel_table(LLMEngine(config, hardware_spec=hardware_for_config(config)))


def with_kernel_table(engine: LLMEngine, force: bool = False) -> LLMEngine:
    """`engine`, its step predictions now priced by its own kernels timed at its model's shapes and dtypes
    (measure/shape_kernels.py: measured once per CPU, model shape and dtypes, then read from the cache), where
    it predicts on the local CPU's probe with one rank; any other engine as it is (an expert-parallel one too: its
    sparse blocks hold collectives, and the table would time a whole block where a rank runs 1/N of it)."""
    cost = engine.step_cost_predictor
    if (cost is None or engine.device.type != "cpu" or cost.hw.name != LOCAL_CPU
            or max(cost.predictor.tp, cost.predictor.ep) * cost.predictor.pp > 1 or not cpu_ops.available()):
        return engine
    try:
        table = kernel_table_for(engine, force=force)
    except (AttributeError, RuntimeError, ValueError) as e:  # a model whose layers the probe cannot time
        logger.warning("kernel table not measured (%s): predictions from the probe's peaks and rates", e)
        return engine
    cost.use_hardware(cost.hw.replace(kernel_tables={**cost.hw.kernel_tables, table["key"]: table}))
    return engine


def local_gloo_link(measure: bool = True, force: bool = False) -> Optional[LinkSpec]:
    """This machine's gloo all-reduce and the other collectives of a parallel step (the step plan's broadcasts,
    expert parallelism's all-to-alls and all-gathers) between two local processes (parallel/link_probe.py): read
    from its cache, else measured now (seconds; two spawned processes each) when `measure`, else None (a cached
    link without the step's collectives or the ranks' spread on equal work, from before they were measured so:
    those measured now, or as it is)."""
    key = local_link_key()
    link = None if force else cached_local_link(key)
    if link is None and measure:
        link = fit_local_link(measure_all_reduce(), source=f"measured here: gloo, 2 processes ({key})")
    if link is not None and not (link.a2a_bandwidth and link.ag_bandwidth and link.desync) and measure:
        link = fit_step_collectives(measure_step_collectives(), link)
        save_local_link(key, link)
    return link


def local_kv_link(measure: bool = True, force: bool = False) -> Optional[LinkSpec]:
    """What a prompt's KV costs to hand from one local engine process to another (measure/kv_send.py: the
    disaggregated engine's own gather, header, gloo send/recv and scatter, fitted to latency + bytes /
    bandwidth): read from its cache, else measured now (seconds; two spawned processes) when `measure`, else
    None. sim/disagg.py prices a local transfer on it, not on the all-reduce link above."""
    key = kv_send_key(local_link_key())
    link = None if force else cached_local_link(key)
    if link is None and measure:
        link = fit_kv_send(measure_kv_send(), source=f"measured here: the KV send path, 2 processes ({key})")
        save_local_link(key, link)
    return link
