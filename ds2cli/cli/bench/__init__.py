"""`ds2 bench`: load, prefill and decode speed, held against what this machine's memory and BLAS
can do (llama-bench for ds2). One concern a module, each importing only those below it:

    command     the click command: parse, call, render
    formats     --formats: rounds of `ds2 bench` processes, then every format side by side
    measure     timing the model: load, prefill and decode runs, their repeats, peak RSS
    compare_hf  --compare-hf: the same runs through Hugging Face transformers
    synthetic   the DeepSeek-V2-Lite-shaped checkpoint with random weights
    accounting  bytes and FLOPs a forward needs, from the loaded model
    probes      matvec bandwidth and GEMM throughput: the machine's ceilings
    report      the tables (rich) drawn from a report
    settings    the token counts a run asks for, against the model; BenchError
    timing      seconds() and summary(), the two things every measurement uses
"""

from ds2cli.bench.command import bench

__all__ = ["bench"]
