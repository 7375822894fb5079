"""The CUDA wing: what a GPU adds to the device-neutral ModelRunner.

wing.py: the rank's device and its step runner; graph_runner.py: decode steps replayed from CUDA
graphs; graph_plan.py: the batch sizes captured, the padding of a batch to one, what the graphs
were captured against.
"""
