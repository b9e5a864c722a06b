"""servescope.kernels.cpu: the C++ extension (csrc/, built on first use by extension.py) and its Python
entry points: ops.py (norms, rotary, the KV store, paged and prefill attention), linear.py (the GEMV, the
panel GEMM, oneDNN's prepacked GEMM)."""
