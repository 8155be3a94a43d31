"""`ds2 bench`: load, prefill and decode speed, held against what this machine's memory and BLAS
can do (llama-bench for ds2). One concern a module; bottom-up, each importing only those before it:

Bottom-up:
    timing      seconds() and summary(), the two things every measurement uses
    settings    the token counts a run asks for, against the model; BenchError
    report      the tables (rich) drawn from a report
    accounting  bytes and FLOPs a forward needs, from the loaded model
    probes      matvec bandwidth, GEMM throughput and NumPy's widening ceiling (over a large
                matrix, and over a decode step's own matrices): the machine's ceilings
    profile     --profile: where a decode step's time goes (products, attention, router, the rest)
    synthetic   the DeepSeek-V2-Lite-shaped checkpoint with random weights
    compare_hf  --compare-hf: the same runs through Hugging Face transformers
    measure     timing the model: load, prefill and decode runs, their repeats, peak RSS
    formats     --formats: rounds of `ds2 bench` processes, then every format side by side
    cluster     --ray: prefill and decode over a Ray cluster, with the traffic between its nodes
    command     the click command: parse, call, render
"""

from ds2cli.cli.bench.command import bench

__all__ = ["bench"]
