"""servescope.kernels.triton: the Triton kernels of a GPU (attention, fused element-wise ops, the dense
and packed GEMVs). Importing this package imports no triton: its modules do, and the callers import
them lazily, so a CPU-only start-up never pays for triton."""
