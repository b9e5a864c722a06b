"""The worker entry point of a tensor/pipeline-parallel engine: ranks 1..world-1, started by the
engine (torch.multiprocessing) or by torchrun (every rank runs the CLI; ranks > 0 end up here).

A worker loads the same weights, keeps its stage and shard, allocates its KV cache when rank 0 says
how many blocks, then runs each step plan it receives until STOP. It never schedules: which tokens,
slots and blocks a step uses is all in the plan.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch

from servescope.config import EngineConfig
from servescope.engine.kv_sizing import kv_group_blocks
from servescope.engine.model_runner import ModelRunner, step_batch_from_buffer
from servescope.engine.parallel_executor import (ParallelExecutor, local_step, parallel_layout, shard_model,
                                                 uses_decode_plan)
from servescope.engine.weights import build_weights, resolve_device, resolve_dtypes
from servescope.kernels.cpu import ops as cpu_ops
from servescope.parallel import plan
from servescope.parallel.groups import (WORKER_TIMEOUT_S, backend_for, context, destroy_group, init_group,
                                       mark_ready, torchrun_rank, worker_store)
from servescope.parallel.launcher import watch_parent

logger = logging.getLogger(__name__)


def worker_main(rank: int, flat_config: dict, store_port: Optional[int], parent_pid: Optional[int]) -> None:
    """Run rank `rank` until rank 0 sends STOP (or the engine's process goes away). store_port: rank 0's
    store on localhost (None under torchrun: env://). After a REBUILD the same process serves the next
    engine (parked workers, see parallel/launcher.py)."""
    if parent_pid is not None:
        watch_parent(parent_pid)
    store, generation, joined = None, 0, False
    while flat_config is not None:
        config = EngineConfig(**{**flat_config, "skip_tokenizer_init": True})
        model, model_config, layout, device = _build(config, rank)
        if store_port is not None and store is None:
            store = worker_store(store_port, layout.world_size)
        if store is not None:
            mark_ready(store, rank, generation)
        if not joined:
            ctx = init_group(layout, rank, backend_for(device, config.parallel.distributed_backend), store,
                             WORKER_TIMEOUT_S)
            joined = True
        else:  # the same processes and process group, maybe another layout: its TP groups again
            ctx = context(layout, rank, WORKER_TIMEOUT_S)
        ex = ParallelExecutor.prepare(shard_model(model, ctx), device, config.load.quantization,
                                      config.load.gpu_linear, decode_plan=uses_decode_plan(layout), ctx=ctx)
        flat_config = _serve(ex, config, model_config, ex.attention_backend(config.load.attention_backend), device)
        generation += 1
    destroy_group()
    if parent_pid is not None:  # a spawned worker: skip torch's interpreter teardown (seconds on a busy
        sys.stdout.flush()      # machine) so that the engine's shutdown does not wait for it
        sys.stderr.flush()
        os._exit(0)


def _build(config: EngineConfig, rank: int) -> tuple:
    """(the built model, its ModelConfig, the checked layout, the device) of this rank."""
    device = resolve_device(config)
    if device.type == "cuda":
        run = torchrun_rank()
        device = torch.device("cuda", run[2] if run else rank)
        torch.cuda.set_device(device)
    dtype, _ = resolve_dtypes(config, device)
    model_config, model, _tok, _path = build_weights(config, device, dtype, count_devices=False)
    if device.type == "cpu":
        cpu_ops.cache_host_memory()  # this rank runs its share of every step (kernels/cpu/csrc/host_cache.cpp)
    return model, model_config, parallel_layout(config, model_config, device, count_devices=False), device


def _serve(ex: ParallelExecutor, config: EngineConfig, model_config, backend, device: torch.device) -> Optional[dict]:
    """Run step plans until STOP (returns None) or REBUILD (returns the next engine's settings)."""
    runner = None
    while True:
        msg = plan.receive(device)
        if msg.command == plan.STOP:
            return None
        if msg.command == plan.REBUILD:
            return plan.rebuild_config(msg)
        if msg.command == plan.ALLOCATE_KV:
            blocks, block_size, dtype_index = msg.header[1:4]
            # the pools of every group, by rank 0's rule on the same inputs; the stage's layers take their groups'
            runner = ModelRunner(ex, ex.shard_config(model_config), backend, blocks, block_size,
                                 plan.KV_DTYPES[dtype_index], device,
                                 group_blocks=kv_group_blocks(config, model_config, blocks))
            continue
        t, b, max_blocks, decodes, _ = msg.dims
        buf, logits_rows, cuts, widths = msg.step_parts()
        batch = step_batch_from_buffer(buf, t, b, max_blocks, decodes, groups=tuple(zip(runner.group_windows, widths)))
        with torch.inference_mode():
            local_step(ex, batch, runner.kv_caches, backend, logits_rows, cuts)


def become_torchrun_worker(config: EngineConfig) -> None:
    """Under torchrun with a parallel config, on ranks > 0: run this rank's worker loop in place of the
    engine being built, then exit the process (SystemExit 0) when rank 0 stops, so that every rank can
    run the same command (`torchrun ... -m servescope.cli serve -tp 2`). Elsewhere: nothing."""
    run = torchrun_rank()
    if run is None or run[0] == 0 or config.parallel.world_size == 1:
        return
    worker_main(run[0], config.flat(), None, None)
    raise SystemExit(0)
