"""servescope.quant: weight quantisation as maths over torch tensors, no modules and no kernels: the
packed formats (scheme.py, packed.py), the per-channel int8 form (per_channel.py), the scale search
(search.py) and GPTQ (gptq.py)."""
