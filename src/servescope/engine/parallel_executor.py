"""ParallelExecutor: the executor of a tensor/pipeline-parallel engine, and the step every rank runs
(parallel/ has the pieces; engine/parallel_worker.py the other ranks' loop; this file is the glue).

Shape legend: T tokens in the step, B' rows whose logits are due, Dm model width, V vocabulary.

Rank 0 runs the whole engine (scheduler, sampler, outputs) with this executor. Each step it
broadcasts the step plan (parallel/plan.py) and then runs its own part of the step exactly as every
worker does (`local_step`): the first stage embeds, each stage runs its layers (tensor-parallel
shards all-reduce inside them), hands (h, residual) to the next stage, and the last stage computes
its vocabulary shard of the logits, gathered on its shard 0 and sent to rank 0.

Failure: a worker that has exited is seen before the step; one that dies or hangs during a step
makes a collective fail (peer closed) or time out (distributed_timeout_s) on rank 0. Either way the
step raises WorkerFailedError, the executor stays failed (the group is broken), and shutdown ends the
workers. Accelerated on each shard: the CPU GEMV / oneDNN linears (and int8), and at TP = 1 the C++
decode plan over a pipeline stage's layers (decode-only micro-batches); not at TP > 1: the decode
plan and CUDA graphs (a layer needs collectives between its kernels).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from servescope.analysis.pipeline_schedule import auto_micro_batches
from servescope.config import EngineConfig, ModelConfig
from servescope.engine.executor import ExecutorStepStats, ModelExecutor
from servescope.errors import EngineConfigError, WorkerFailedError
from servescope.kernels.cpu.gemv_limits import cached_only
from servescope.model.moe import moe_blocks
from servescope.parallel import plan
from servescope.parallel.expert_parallel import apply_expert_parallel
from servescope.parallel.groups import (START_TIMEOUT_S, DistContext, backend_for, context, destroy_group,
                                       free_port, init_group, master_store, torchrun_rank, wait_ready)
from servescope.parallel.launcher import ParkedGroup, WorkerGroup, park, take_parked
from servescope.parallel.layout import ParallelLayout, check_parallel, local_kv_heads
from servescope.parallel.microbatch import choose_cuts, micro_batches
from servescope.parallel.pipeline import keep_stage, recv_stage_routing, run_stage, send_stage_routing
from servescope.parallel.tensor_parallel import apply_tensor_parallel

logger = logging.getLogger(__name__)


def parallel_layout(config: EngineConfig, cfg: ModelConfig, device: torch.device,
                    count_devices: bool = True) -> Optional[ParallelLayout]:
    """The checked layout of a parallel engine (None: one process). Raises before any process starts.
    count_devices False: a worker, whose engine has counted them already."""
    par = config.parallel
    if par.world_size == 1:
        return None
    run = torchrun_rank()
    if not count_devices:
        n, kind = par.world_size, "ranks"
    elif run is not None:  # torchrun started the ranks, possibly over several machines
        if run[1] != par.world_size:
            raise EngineConfigError(f"torchrun started {run[1]} processes, but tensor_parallel_size x "
                                    f"pipeline_parallel_size is {par.world_size}")
        n, kind = run[1], "torchrun processes"
    elif device.type == "cuda":
        n, kind = torch.cuda.device_count(), "CUDA devices"
    else:
        n, kind = os.cpu_count() or 1, "CPU cores"  # each rank needs a core of its own
    return check_parallel(cfg, par.tensor_parallel_size, par.pipeline_parallel_size, n, kind,
                          par.expert_parallel_size)


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """The stage's layers, then the tensor-parallel shards of what is left, then this rank's experts."""
    keep_stage(model, ctx)
    if ctx.layout.tp > 1:
        apply_tensor_parallel(model, ctx)
    if ctx.layout.ep > 1:
        apply_expert_parallel(model, ctx)
    return model


def uses_decode_plan(layout: ParallelLayout) -> bool:
    """The C++ decode plan runs a rank's layers only where no collective sits between their kernels."""
    return layout.tp == 1 and layout.ep == 1


class ParallelExecutor(ModelExecutor):
    def __init__(self, model, device, ctx: DistContext, workers: Optional[WorkerGroup] = None, decode_plan=None):
        super().__init__(model, device, decode_plan=decode_plan)
        self.ctx, self.workers = ctx, workers
        self.failure: Optional[str] = None
        self.timeout_s = 0.0  # rank 0's collective timeout (distributed_timeout_s), for the error message
        self.vocab_size = model.config.vocab_size
        self.micro_batches = 0  # pipeline_micro_batches (0: auto)
        self._last = ExecutorStepStats()  # rank 0's collectives and micro-batches in the last step
        self.group: Optional[ParkedGroup] = None  # rank 0: the workers and their store (None: torchrun)
        # at garbage collection or exit too: STOP while the group is healthy, then wait, then terminate
        self._health = {"ok": True, "device": device}
        self._finalizer = weakref.finalize(self, _stop, workers, ctx.rank == 0, self._health)
        self.stage_routing = ([], [])  # rank 0 of a pipeline: the later stages' routing of the last step
        self.expert_bytes = 0  # one routed expert's bytes (set before the stages are cut: stage 0 may hold none)

    @classmethod
    def prepare(cls, *args, **kwargs) -> "ParallelExecutor":
        """ModelExecutor.prepare with the GEMV's row limits read from the cache, none timed here: every rank
        builds its shards at once, and a rank timing its kernels while the others time theirs would measure
        them as load (kernels/cpu/gemv_limits.cached_only)."""
        with cached_only():
            return super().prepare(*args, **kwargs)

    @classmethod
    def start(cls, config: EngineConfig, model, device: torch.device, layout: ParallelLayout,
              worker_target) -> "ParallelExecutor":
        """Rank 0: start the workers (or rebuild parked ones; none under torchrun), join the group,
        shard, prepare."""
        par = config.parallel
        backend = backend_for(device, par.distributed_backend)
        group = None
        if torchrun_rank() is None:
            group = take_parked(layout.world_size, backend, par.distributed_timeout_s)
        try:
            if group is not None:  # the processes and the process group are there: new weights only
                group.generation += 1
                plan.send_rebuild(config.flat(), device)
                wait_ready(group.store, layout.world_size, group.workers.check_alive, START_TIMEOUT_S,
                           group.generation)
                ctx = context(layout, 0, par.distributed_timeout_s)
            else:
                group = cls._spawn(config, layout, worker_target, backend)
                ctx = init_group(layout, 0, backend, group.store if group else None, par.distributed_timeout_s)
        except Exception as e:
            if group is not None:
                group.workers.shutdown(0.0)
            destroy_group()
            raise WorkerFailedError(f"the parallel workers did not start: {e}") from e
        logger.info("parallel engine: tensor_parallel_size=%d x pipeline_parallel_size=%d, "
                    "expert_parallel_size=%d over %s", layout.tp, layout.pp, layout.ep, backend)
        blocks = moe_blocks(model)  # (before the stages are cut: stage 0 may hold no sparse layer)
        expert_bytes = blocks[0][1].experts.expert_bytes() if blocks else 0
        try:  # (a model the transforms refuse, say packed experts under TP: every rank raises the same)
            ex = cls.prepare(shard_model(model, ctx), device, config.load.quantization, config.load.gpu_linear,
                             decode_plan=uses_decode_plan(layout), ctx=ctx, workers=group.workers if group else None)
        except Exception:
            if group is not None:  # no process group, no worker left behind for the next engine to trip on
                group.workers.shutdown(0.0)
            destroy_group()
            raise
        ex.timeout_s, ex.group, ex.micro_batches = par.distributed_timeout_s, group, par.pipeline_micro_batches
        ex.expert_bytes = expert_bytes
        return ex

    @staticmethod
    def _spawn(config: EngineConfig, layout: ParallelLayout, worker_target, backend: str) -> Optional[ParkedGroup]:
        """New worker processes reporting to a new store (None under torchrun, which started them)."""
        if torchrun_rank() is not None:
            return None
        port = free_port()
        store = master_store(port, layout.world_size)
        workers = WorkerGroup(worker_target, layout.world_size, (config.flat(), port))
        group = ParkedGroup(workers, store, layout.world_size, backend, timeout_s=config.parallel.distributed_timeout_s)
        try:
            wait_ready(store, layout.world_size, workers.check_alive, START_TIMEOUT_S)
        except Exception:
            workers.shutdown(0.0)
            raise
        return group

    # ---------------------------------------------------------------- what this rank holds
    def shard_config(self, cfg: ModelConfig) -> ModelConfig:
        """This rank's heads, MLP columns and its stage's layers with their kinds (on rank 0: stage 0's, the most
        of any stage, so that the KV blocks it sizes fit every rank)."""
        tp, layout = self.ctx.layout.tp, self.ctx.layout
        stage = cfg.layers_config(layout.stage_layers(self.ctx.stage))
        assert stage.num_hidden_layers == len(self.model.model.layers), "the stage's layers are the model's"
        return dataclasses.replace(stage, num_attention_heads=cfg.num_attention_heads // tp,
                                   num_key_value_heads=local_kv_heads(cfg, tp),
                                   intermediate_size=cfg.intermediate_size // tp)

    def start_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Every worker allocates a KV cache of the same blocks for its own heads and layers."""
        self._guarded(plan.send_command, plan.ALLOCATE_KV,
                      (num_blocks, block_size, plan.KV_DTYPES.index(kv_dtype)), self.device)

    def fork(self):
        raise EngineConfigError("a tensor/pipeline-parallel engine cannot share its weights with another "
                                "engine (with_config); build a new engine")

    def capture_cuda_graphs(self, runner, batch_sizes, max_blocks_per_seq: int) -> None:
        logger.info("CUDA graphs are not captured for a parallel engine (collectives inside the layers)")

    # ---------------------------------------------------------------- the step
    def run(self, batch, kv_caches: list, backend, logits_indices: torch.Tensor) -> torch.Tensor:
        self.ctx.comm.take()
        self.ctx.experts.take()
        out, cuts = self._guarded(self._plan_and_step, batch, kv_caches, backend, logits_indices)
        seconds, nbytes = self.ctx.comm.take()
        a2a_seconds, a2a_bytes, rows = self.ctx.experts.take()
        rows = rows + self.stage_routing[1] if rows else rows  # (the later stages' ranks after stage 0's)
        self._last = ExecutorStepStats(seconds, nbytes, len(cuts) + 1 if self.ctx.layout.pp > 1 else 0,
                                       a2a_seconds, a2a_bytes, rows)
        return out

    def take_routing(self) -> tuple:
        """Stage 0's routing, then the later stages' (sent to rank 0 with each step)."""
        per_layer, _ = super().take_routing()
        return per_layer + self.stage_routing[0], self.expert_bytes

    def step_stats(self) -> ExecutorStepStats:
        return self._last

    def _plan_and_step(self, batch, kv_caches, backend, logits_indices) -> tuple:
        cuts = []
        if self.ctx.layout.pp > 1:
            prefill_tokens = batch.num_tokens - batch.meta.num_decode_seqs
            m = auto_micro_batches(prefill_tokens, self.ctx.layout.pp, self.micro_batches)
            cuts = choose_cuts(batch.meta, m, kv_caches[0][0].shape[1])  # [N, S, Hkv, D]: S
        plan.send_step(batch, logits_indices, self.ctx.comm, cuts)
        return local_step(self, batch, kv_caches, backend, logits_indices, cuts), cuts

    def _guarded(self, fn, *args):
        """fn(*args), with any failure of the group turned into WorkerFailedError (and remembered)."""
        if self.failure is not None:
            raise WorkerFailedError(self.failure)
        try:
            if self.workers is not None:
                self.workers.check_alive()
            return fn(*args)
        except WorkerFailedError as e:
            self.failure = f"a parallel worker failed: {e}; the engine must be restarted"
        except (RuntimeError, dist.DistError) as e:
            self.failure = (f"a collective with the parallel workers failed ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0]}): a worker died or did not answer within "
                            f"{self.timeout_s:g} s; the engine must be restarted")
        self._health["ok"] = False
        logger.error(self.failure)
        raise WorkerFailedError(self.failure)

    def shutdown(self, keep_workers: bool = False) -> None:
        """Stop the workers (a STOP message when the group is healthy, else terminate) and leave the
        group; keep_workers: park a healthy group instead, for the next parallel engine of the same
        world size in this process (its workers then load the new weights, no new processes)."""
        healthy = self.failure is None and self.ctx.rank == 0
        if healthy and keep_workers and self.group is not None and self._finalizer.alive:
            self._finalizer.detach()
            park(self.group)
            return
        self._finalizer()


def _stop(workers: Optional[WorkerGroup], is_root: bool, health: dict) -> None:
    if is_root and health["ok"]:  # spawned workers or torchrun's: both wait for this
        try:
            plan.send_command(plan.STOP, device=health["device"])
        except Exception:  # noqa: BLE001 - a broken group: the workers are terminated below
            logger.warning("could not send STOP to the workers")
    if workers is not None:
        workers.shutdown()
    if is_root:
        destroy_group()


def local_step(ex, batch, kv_caches: list, backend, logits_indices: torch.Tensor,
               cuts: list = ()) -> Optional[torch.Tensor]:
    """This rank's part of one step (every rank, the same order of collectives), in the micro-batches
    `cuts` makes of it on a pipeline. Returns the float32 logits [B', V] on rank 0, None elsewhere. A mixture
    of experts on a pipeline: then each later stage's routing goes to rank 0 (parallel/pipeline.py)."""
    out = _stage_step(ex, batch, kv_caches, backend, logits_indices, cuts)
    ctx = ex.ctx
    if ctx.layout.pp > 1 and ex.model.config.moe is not None:
        if ctx.rank == 0:
            ex.stage_routing = recv_stage_routing(ex.model.config, ctx, ex.device)
        elif ctx.shard == 0:
            send_stage_routing(ex.model, ctx)
    return out


def _stage_step(ex, batch, kv_caches: list, backend, logits_indices: torch.Tensor, cuts) -> Optional[torch.Tensor]:
    ctx, model = ex.ctx, ex.model
    pieces = micro_batches(batch.input_ids, batch.positions, batch.meta, list(cuts))

    def layers(mb, h, residual):  # the first layer path that serves the micro-batch (the whole step at PP 1)
        path = ex.layers_for(mb.num_tokens, mb.meta, kv_caches, backend)
        return path.run_layers(h, residual, mb.positions, kv_caches, mb.meta, backend)

    h, residual = run_stage(model, pieces, layers, ctx, model.model.norm.weight.dtype)
    if ctx.layout.tp == 1 and ctx.shard != 0:  # a replica of the attention (expert parallel): rank 0 samples
        return None
    if not ctx.is_last_stage:
        return _logits_from_last_stage(ex, logits_indices.numel()) if ctx.rank == 0 else None
    n = logits_indices.numel()
    if n == 0:
        return torch.empty(0, ex.vocab_size, device=ex.device) if ctx.rank == 0 else None
    local = model.compute_logits(model.final_norm(h, residual)[logits_indices])  # [B', V/Tp]
    logits = _gather_vocab(ex, local)
    if ctx.rank == ctx.tp_root and ctx.rank != 0:
        ctx.comm.timed(dist.send, logits, 0)
        return None
    return logits


def _gather_vocab(ex, local: torch.Tensor) -> Optional[torch.Tensor]:
    """[B', V/Tp] on each shard -> [B', V] on the stage's shard 0 (None on the others)."""
    ctx = ex.ctx
    if ctx.layout.tp == 1:
        return local[:, :ex.vocab_size]
    root = ctx.rank == ctx.tp_root
    parts = [torch.empty_like(local) for _ in range(ctx.layout.tp)] if root else None
    ctx.comm.timed(dist.gather, local.contiguous(), parts, dst=ctx.tp_root, group=ctx.tp_group)
    return torch.cat(parts, dim=-1)[:, :ex.vocab_size] if root else None


def _logits_from_last_stage(ex, n: int) -> torch.Tensor:
    """Rank 0 (not the last stage): the logits [B', V] from the last stage's shard 0."""
    out = torch.empty(n, ex.vocab_size, dtype=torch.float32, device=ex.device)
    if n:
        ex.ctx.comm.timed(dist.recv, out, ex.ctx.layout.rank_of(ex.ctx.layout.pp - 1, 0))
    return out
