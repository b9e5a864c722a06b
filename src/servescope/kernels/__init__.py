"""servescope.kernels: CPU extension sources and their Python entry points, Triton kernels, kernel probes (no model knowledge)."""
