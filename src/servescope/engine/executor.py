"""ModelExecutor: the built model plus the kernel choices made for it, once, at build time.

Shape legend: T tokens in the step, B sequences whose next token is due, Dm model width, V vocabulary.

The model has one forward (embed -> layers -> norm) and one output head. Which kernels serve a step
is decided here, not inside the model: on the CPU the all-layers C++ decode plan for decode-only
steps; on a GPU replayed CUDA graphs; everywhere else the model's own forward. The linear modules
the model calls (dense, int8, the CPU GEMV/oneDNN linear, the Triton GEMV) were swapped in by the
transforms in `prepare`, before the first step.

`fork()` gives an executor on the same weights for another runner (another KV cache): graphs
captured against one runner's cache are never shared.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch

from servescope.engine.cuda_graphs import CudaGraphRunner
from servescope.errors import EngineConfigError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.quantize import quantize_model
from servescope.model.transforms import cpu_decode_plan, use_cpu_linears

logger = logging.getLogger(__name__)


class ModelExecutor:
    last_comm = (0.0, 0)  # (seconds, bytes) in collectives during the last step: none in one process
    last_micro_batches = 0  # the pipeline micro-batches of the last step (0: no pipeline)

    def __init__(self, model: torch.nn.Module, device: torch.device, gpu_linear_choice: Optional[dict] = None,
                 decode_plan=None, decode_plan_max_rows: int = 0):
        self.model = model
        self.device = device
        self.gpu_linear_choice = gpu_linear_choice or {}
        # the C++ all-layers decode call (model/transforms.py) and the most tokens per step it serves
        self.decode_plan, self.decode_plan_max_rows = decode_plan, decode_plan_max_rows
        self.graphs = None  # CudaGraphRunner once captured (capture_cuda_graphs)

    @classmethod
    def prepare(cls, model: torch.nn.Module, device: torch.device, quantization: Optional[str] = None,
                gpu_linear: str = "cublas", decode_plan: bool = True, **kwargs) -> "ModelExecutor":
        """Apply the build-time transforms to a loaded model and return its executor. decode_plan
        False: no C++ all-layers decode call (a sharded model: its layers need collectives between
        kernels); kwargs go to the constructor (a subclass's own)."""
        if quantization:
            model = quantize_model(model, quantization)
        ex = cls(model, device, **kwargs)
        if device.type == "cpu" and cpu_ops.load() is not None:  # builds the extension now (once, ~40 s), not in a step
            use_cpu_linears(model)
            if decode_plan:
                ex.decode_plan, ex.decode_plan_max_rows = cpu_decode_plan(model)
        ex.gpu_linear_choice = ex._select_gpu_linear(gpu_linear)
        return ex

    def fork(self) -> "ModelExecutor":
        """The same weights and kernel choices, no captured graphs (for a runner with its own KV cache)."""
        return ModelExecutor(self.model, self.device, self.gpu_linear_choice, self.decode_plan,
                             self.decode_plan_max_rows)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer the steps read (the rotary tables excluded)."""
        rot = {id(self.model.rotary.cos), id(self.model.rotary.sin)}
        return sum(t.numel() * t.element_size() for t in
                   itertools.chain(self.model.parameters(), self.model.buffers()) if id(t) not in rot)

    # ---------------------------------------------------------------- the step
    def forward(self, batch, kv_caches: list, backend) -> torch.Tensor:
        """StepBatch -> hidden [T, Dm] (a CUDA graph serves only decode-only steps, where T == B)."""
        meta = batch.meta
        if self.graphs is not None and meta.is_decode_only and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        if self._plan_serves(batch, kv_caches, backend):
            # the same kernels as the model's forward, issued from C++ (no Python per layer)
            h = self.model.model.embed_tokens(batch.input_ids)  # [T] -> [T, Dm]
            cos, sin = self.model.rotary.table(batch.positions)
            return self.decode_plan.run(h, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                        meta.context_lens)
        return self.model(batch.input_ids, batch.positions, kv_caches, meta, backend)

    def _plan_serves(self, batch, kv_caches: list, backend) -> bool:
        """Decode-only steps within the plan's row limit, on the torch backend's cache layout."""
        return (self.decode_plan is not None and batch.meta.is_decode_only
                and batch.num_tokens <= self.decode_plan_max_rows and backend.name == "torch"
                and not torch.is_grad_enabled() and kv_caches[0][0].dtype in cpu_ops.KV_DTYPES)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] -> float32 logits [B, V]."""
        return self.model.compute_logits(hidden)

    def run(self, batch, kv_caches: list, backend, logits_indices: torch.Tensor) -> torch.Tensor:
        """One step: the forward, then float32 logits [B', V] of the rows `logits_indices` of T (the
        seam a parallel executor overrides: it sends the plan to its workers first)."""
        return self.compute_logits(self.forward(batch, kv_caches, backend)[logits_indices])

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
        # lazy: importing triton costs ~0.35 s of every start-up (measured here), and only GPUs use it
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
