"""servescope.kernels: the kernels and their dispatch, no model knowledge: cpu/ (the C++ extension and
its Python entry points), triton/ (the GPU's Triton kernels), fused_ops.py (the element-wise ops'
one dispatch point). Their rate probes are measure/kernel_rates.py, above the engine."""
