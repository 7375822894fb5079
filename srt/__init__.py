"""srt: replicated-scheduler SPMD inference server."""
