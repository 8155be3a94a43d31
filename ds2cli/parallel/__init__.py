"""Execution: the cores a pass runs on. The math asks `cores` for parallelism (`split`, `map`) and
knows nothing else of threads, BLAS or processes; low-bit kernels hand a decode step's rows to the
forked helper `processes`. Imports only errors (nothing of the model, weights or text above it).

Bottom-up:
    cores       the worker pool, BLAS thread control, split/map (what the math asks)
    processes   the forked helper processes of a few-token pass, and their pipe protocol
"""
