"""servescope.model.linears: the nn.Modules that replace nn.Linear (and nn.Embedding) at build time, one
module per kind: cpu.py (CpuLinear: dense weights on the CPU's kernels), int8.py (Int8Linear: per-channel
int8), packed.py (QuantLinear, QuantEmbedding: the packed 4- and 8-bit forms of servescope.quant).
model/quantize.py and model/transforms.py swap them in."""
