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

from servescope.errors import EngineConfigError
from servescope.model.optimize import optimize_model

logger = logging.getLogger(__name__)


class ModelExecutor:
    def __init__(self, model: torch.nn.Module, device: torch.device, gpu_linear_choice: Optional[dict] = None):
        self.model = model
        self.device = device
        self.gpu_linear_choice = gpu_linear_choice or {}
        self.graphs = None  # CudaGraphRunner once captured (capture_cuda_graphs)

    @classmethod
    def prepare(cls, model: torch.nn.Module, device: torch.device, quantization: Optional[str] = None,
                gpu_linear: str = "cublas") -> "ModelExecutor":
        """Apply the build-time transforms to a loaded model and return its executor."""
        model = optimize_model(model, quantization=quantization)
        ex = cls(model, device)
        ex.gpu_linear_choice = ex._select_gpu_linear(gpu_linear)
        return ex

    def fork(self) -> "ModelExecutor":
        """The same weights and kernel choices, no captured graphs (for a runner with its own KV cache)."""
        return ModelExecutor(self.model, self.device, self.gpu_linear_choice)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer the steps read (the rotary tables excluded)."""
        rot = {id(self.model.rotary.cos), id(self.model.rotary.sin)}
        return sum(t.numel() * t.element_size() for t in
                   itertools.chain(self.model.parameters(), self.model.buffers()) if id(t) not in rot)

    # ---------------------------------------------------------------- the step
    def forward(self, batch, kv_caches: list, backend) -> torch.Tensor:
        """StepBatch -> hidden [T, Dm] (a CUDA graph serves only decode-only steps, where T == B)."""
        if self.graphs is not None and batch.meta.is_decode_only and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, kv_caches, batch.meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Dm] -> float32 logits [B, V]."""
        return self.model.compute_logits(hidden)

    # ---------------------------------------------------------------- GPU choices
    def _select_gpu_linear(self, mode: str) -> dict:
        """Route the decode matmuls to the Triton GEMV (triton) or to whichever of it and cuBLAS is
        faster per shape (auto); before CUDA graphs are captured, which then hold the choice."""
        if mode == "cublas":
            return {}
        if self.device.type != "cuda":
            logger.warning("gpu_linear=%s applies to CUDA devices only; ignored on %s (the CPU has its own "
                           "decode GEMV)", mode, self.device.type)
            return {}
        from servescope.kernels import triton_gemv

        if not triton_gemv.AVAILABLE:
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
            return self._select_gpu_linear(mode)
        from servescope.kernels import triton_gemv

        self.gpu_linear_choice = triton_gemv.select(self.model, mode)
        if self.graphs is not None:
            sizes, max_blocks = self.graphs.batch_sizes, self.graphs.max_blocks_per_seq
            self.graphs = None  # frees the old graphs' pool before the new capture
            torch.cuda.empty_cache()
            self.capture_cuda_graphs(runner, sizes, max_blocks)
        return self.gpu_linear_choice

    def capture_cuda_graphs(self, runner, batch_sizes, max_blocks_per_seq: int) -> None:
        from servescope.engine.cuda_graphs import CudaGraphRunner

        g = CudaGraphRunner(self.model, runner, batch_sizes, max_blocks_per_seq)
        g.capture()
        self.graphs = g
