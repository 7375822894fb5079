"""Native kernels: fused CPU kernels for the bf16 path (cpu.py builds and loads cpu_kernels.c)."""
