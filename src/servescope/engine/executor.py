"""ModelExecutor: the built model plus the kernel choices made for it, once, at build time.

Shape legend: T tokens in the step, B sequences whose next token is due, Dm model width, V vocabulary.

A forward is the model's four steps: `embed`, `run_layers`, `final_norm`, `compute_logits`. The
kernels are chosen here, once, not inside the model: the linear modules and the layer paths in
`prepare`, the attention backend in `attention_backend`. What serves the layers: the list `layer_paths`
holds, in order of preference, the C++ decode plan (CPU, decode-only steps) and the model's own
`run_layers` (every step), and each step takes the first that serves it. Replayed CUDA graphs
(GPU, decode-only) capture the whole composition and come before both. The linear modules the model
calls (dense, int8, the CPU GEMV/oneDNN linear, the Triton GEMV) were swapped in by the transforms in
`prepare`, before the first step. A pipeline stage (parallel executor) runs the same layer paths over
its own layers.

`fork()` gives an executor on the same weights for another runner (another KV cache): graphs
captured against one runner's cache are never shared.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from servescope.engine.cuda_graphs import CudaGraphRunner
from servescope.errors import EngineConfigError
from servescope.model.attention import AttentionBackend, get_attention_backend
from servescope.model.moe import take_step_routing
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.quantize import quantize_model
from servescope.model.transforms import cpu_decode_plan, use_cpu_linears

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutorStepStats:
    """What the executor's last step spent outside the model's arithmetic."""

    comm_seconds: float = 0.0  # rank 0's time inside collectives
    comm_bytes: int = 0
    micro_batches: int = 0  # the pipeline micro-batches the step was cut into (0: no pipeline)
    # expert parallelism (parallel/expert_parallel.py): rank 0's time and bytes sent in the all-to-alls (in
    # comm_seconds / comm_bytes too), and the (token, expert) rows each rank's experts ran, over the sparse layers
    all_to_all_seconds: float = 0.0
    all_to_all_bytes: int = 0
    expert_rows_per_rank: list = field(default_factory=list)


class ModelExecutor:
    def __init__(self, model: torch.nn.Module, device: torch.device, gpu_linear_choice: Optional[dict] = None,
                 decode_plan=None):
        self.model = model
        self.device = device
        self.gpu_linear_choice = gpu_linear_choice or {}
        # the C++ all-layers decode call (model/transforms.DecodePlanLayers) or None
        self.decode_plan = decode_plan
        self.layer_paths = ([decode_plan] if decode_plan is not None else []) + [model]
        self.graphs = None  # CudaGraphRunner once captured (capture_cuda_graphs)

    @classmethod
    def prepare(cls, model: torch.nn.Module, device: torch.device, quantization: Optional[str] = None,
                gpu_linear: str = "cublas", decode_plan: bool = True, **kwargs) -> "ModelExecutor":
        """Apply the build-time transforms to a loaded model and return its executor. decode_plan
        False: no C++ all-layers decode call (a sharded model: its layers need collectives between
        kernels); kwargs go to the constructor (a subclass's own)."""
        if quantization:
            model = quantize_model(model, quantization)
        plan = None
        if device.type == "cpu" and cpu_ops.load() is not None:  # builds the extension now, not in a step
            use_cpu_linears(model)
            if decode_plan:
                plan = cpu_decode_plan(model)
        ex = cls(model, device, decode_plan=plan, **kwargs)
        ex.gpu_linear_choice = ex._select_gpu_linear(gpu_linear)
        return ex

    def attention_backend(self, name: str) -> AttentionBackend:
        """The attention kernels of this executor's steps (attention_backend setting: auto | torch |
        triton): chosen here with the executor's other kernels, once."""
        return get_attention_backend(name, self.device)

    def fork(self) -> "ModelExecutor":
        """The same weights and kernel choices, no captured graphs (for a runner with its own KV cache)."""
        return ModelExecutor(self.model, self.device, self.gpu_linear_choice, self.decode_plan)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer the steps read (the rotary tables excluded)."""
        rot = {id(t) for r in (self.model.rotary, getattr(self.model, "rotary_local", None)) if r is not None
               for t in (r.cos, r.sin)}
        return sum(t.numel() * t.element_size() for t in
                   itertools.chain(self.model.parameters(), self.model.buffers()) if id(t) not in rot)

    # ---------------------------------------------------------------- the step
    def layers_for(self, num_tokens: int, meta, kv_caches: list, backend):
        """The first layer path that serves a step (or a pipeline micro-batch) of this shape."""
        for path in self.layer_paths[:-1]:
            if path.serves(meta, num_tokens, kv_caches, backend):
                return path
        return self.layer_paths[-1]

    def forward(self, batch, kv_caches: list, backend) -> torch.Tensor:
        """StepBatch -> hidden [T, Dm] (a CUDA graph serves only decode-only steps, where T == B)."""
        meta = batch.meta
        if self.graphs is not None and meta.is_decode_only and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        layers = self.layers_for(batch.num_tokens, meta, kv_caches, backend)
        h, residual = layers.run_layers(self.model.embed(batch.input_ids), None, batch.positions, kv_caches,
                                        meta, backend)
        return self.model.final_norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] -> float32 logits [B, V]."""
        return self.model.compute_logits(hidden)

    def run(self, batch, kv_caches: list, backend, logits_indices: torch.Tensor) -> torch.Tensor:
        """One step: the forward, then float32 logits [B', V] of the rows `logits_indices` of T (the
        seam a parallel executor overrides: it sends the plan to its workers first)."""
        return self.compute_logits(self.forward(batch, kv_caches, backend)[logits_indices])

    def step_stats(self) -> ExecutorStepStats:
        """What the last step spent in collectives and how it was cut (nothing, in one process)."""
        return ExecutorStepStats()

    def take_routing(self) -> tuple:
        """A mixture of experts' routing since the last call: ([[tokens per expert]] per sparse layer, one routed
        expert's bytes) (model/moe.take_step_routing; a pipeline's rank 0 adds the later stages')."""
        return take_step_routing(self.model)

    def shard_config(self, cfg):
        """The ModelConfig of the part of the model this process holds (its KV cache's shape): the
        whole model here; a tensor/pipeline-parallel executor's shard holds fewer heads or layers."""
        return cfg

    def start_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Called once the runner has its KV cache (a parallel executor's workers allocate theirs)."""

    def shutdown(self, keep_workers: bool = False) -> None:
        """Release what the executor started (nothing here; a parallel executor's worker processes)."""

    # ---------------------------------------------------------------- GPU choices
    def _select_gpu_linear(self, mode: str, force: bool = False) -> dict:
        """Route the decode matmuls to the Triton GEMV (triton) or to whichever of it and cuBLAS is
        faster per shape (auto); before CUDA graphs are captured, which then hold the choice.
        force: run the selection for "cublas" too (a switch back from an earlier choice)."""
        if mode == "cublas" and not force:
            return {}
        if self.device.type != "cuda":
            logger.warning("gpu_linear=%s applies to CUDA devices only; ignored on %s (the CPU has its own "
                           "decode GEMV)", mode, self.device.type)
            return {}
        # lazy: importing triton is start-up time that only a GPU engine uses
        from servescope.kernels.triton import gemv as triton_gemv

        if not triton_gemv.AVAILABLE and mode != "cublas":
            raise EngineConfigError(f"gpu_linear={mode!r} needs triton, which is not available here")
        choice = triton_gemv.select(self.model, mode)
        logger.info("gpu_linear=%s: Triton GEMV for %d of %d (shape, M) cases", mode,
                    sum(v["use"] == "triton" for v in choice.values()), len(choice))
        return choice

    def set_gpu_linear(self, mode: str, runner) -> dict:
        """Switch the decode matmuls to `mode` (cublas | triton | auto) and capture the CUDA graphs
        again when there were any, since they hold the kernels of the moment."""
        if mode not in ("cublas", "triton", "auto"):
            raise EngineConfigError(f"gpu_linear must be cublas, triton or auto, got {mode!r}")
        if self.device.type != "cuda":
            return self._select_gpu_linear(mode)  # warns that it is ignored
        # "cublas" too must undo an earlier choice: select() swaps TritonLinear modules back
        self.gpu_linear_choice = self._select_gpu_linear(mode, force=True)
        if self.graphs is not None:
            sizes, max_blocks = self.graphs.batch_sizes, self.graphs.max_blocks_per_seq
            self.graphs = None  # frees the old graphs' pool before the new capture
            torch.cuda.empty_cache()
            self.capture_cuda_graphs(runner, sizes, max_blocks)
        return self.gpu_linear_choice

    def capture_cuda_graphs(self, runner, batch_sizes, max_blocks_per_seq: int) -> None:
        g = CudaGraphRunner(self.model, runner, batch_sizes, max_blocks_per_seq)
        g.capture()
        self.graphs = g
