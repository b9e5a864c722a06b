"""servescope.measure: measurements of this machine that need the engine itself, above it.

  local_hardware.py  the full CPU probe (analysis/probe.py with the measurers below), the spec a
                     named or local hardware resolves to, the local gloo link between ranks
  overhead.py        the engine's host overhead per step and per layer, on an engine of a tiny model
  kernel_rates.py    the CPU linear kernels' weight rate by rows, decode attention's and the packed
                     integer GEMM's FLOP/s

Entry points above the engine (CLI, server, bench, labs) resolve the hardware here and hand the spec
to the engine they build; the engine never builds a second engine to probe itself.
"""
