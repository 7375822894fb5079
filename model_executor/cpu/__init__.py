"""The CPU wing: what the CPU adds to the device-neutral ModelRunner.

decode_runner.py: the step runner (decode steps as whole fused layers, and the thread governor's
per-step decision); thread_governor.py: fewer torch threads while other processes load the rank's
CPUs; memory.py: glibc malloc settings for a rank process; linear.py: linear layers on weights
packed for the kernels; kernels/: the C kernels, their build, op wrappers and weight layouts.
"""
