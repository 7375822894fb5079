"""Native CPU kernels for the bf16 path, one C interface (srt_kernels.h) over the .c files here.

build.py compiles and loads them and probes what this CPU runs; ops.py calls them on tensors;
packing.py lays weights out for the linear kernels and recovers GGUF blocks; decode_layers.py runs
a decode step's layers as one fused call each.
"""
