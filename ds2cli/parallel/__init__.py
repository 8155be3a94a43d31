"""Execution on this machine: the executor a loaded model is handed by default (the math's
interface is model/executor.py), over a thread pool, BLAS thread control and forked helper
processes. Imports model (the interfaces it implements) and the base modules.

Bottom-up:
    load        how many of this process's cores other programs leave free, read as it runs
    cores       the worker pool, BLAS thread control, split/map, cutting a product's rows
    absorbed    MLA's q and its fold through W_UK as one product (one plan, not two)
    processes   the forked helper processes of a few-token pass, and their pipe protocol
    executor    CoreExecutor: the math's requests over the cores and the helpers; registration
"""
