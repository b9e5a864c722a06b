"""servescope.kernels.triton: the Triton kernels of a GPU (attention, fused element-wise ops, the dense
and packed GEMVs). Importing this package imports no triton: its modules do, so each caller chooses
when to pay for it (the attention backend and the GEMVs import theirs lazily; kernels/fused_ops.py
looks for its kernels when it is itself imported)."""
