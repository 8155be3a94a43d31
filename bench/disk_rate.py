"""The disk's rate for expert reads alone, read as a streamed run (`--memory-budget`) reads them:
--reads random routed experts of a ds2 low-bit checkpoint, spread over its MoE layers, each matrix
in one read into memory of this process's own (weights/expert_cache.ExpertCache.disk_rate, what
`ds2 bench --memory-budget` measures after its steps), buffered (each read's pages dropped after
it, posix_fadvise DONTNEED) and with O_DIRECT (no page cache at all), by one and by two threads
at once. The model's files are dropped from the page cache before each run, so no read finds
its pages there; nothing else's cache is touched, and no root is needed. One line a run:

    buffered, 1 thread: 1.24 GB/s (120 experts, 1.04 GB read)

    python bench/disk_rate.py MODEL [--reads 120] [--threads 1,2] [--seed 0]

MODEL: a ds2 low-bit checkpoint with routed experts (`ds2 quantize`; bench/make_lite.sh makes
the 27-layer V2-Lite shape's). Where the file system refuses O_DIRECT (tmpfs), the O_DIRECT runs
say so and read buffered.
"""

import argparse
import sys

from ds2cli.weights.expert_cache import ExpertCache, StoredExperts
from ds2cli.weights.source import open_model
from ds2cli.weights.streaming import drop_cached
from ds2cli.wording import human_bytes


def rate(cfg, stored: StoredExperts, direct: bool, reads: int, threads: int, seed: int) -> tuple[float, bool]:
    """GB/s of `reads` experts read by `threads` threads, and whether the reads were O_DIRECT."""
    cache = ExpertCache(cfg, stored, slots=1)      # the reads go to scratch memory, not a slot
    cache.direct = direct
    for path in stored.paths:
        drop_cached(path)
    try:
        bytes_per_s = cache.disk_rate(experts=reads, threads=threads, seed=seed)
        return bytes_per_s / 1e9, any(d for _, d in cache.files.values())
    finally:
        cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--reads", type=int, default=120, help="experts read a run (default: 120)")
    ap.add_argument("--threads", default="1,2", help="reading threads, one run each (default: 1,2)")
    ap.add_argument("--seed", type=int, default=0, help="which experts (a run k uses seed + k)")
    args = ap.parse_args()
    source = open_model(args.model)
    if source.stored is None:
        sys.exit(f"error: {args.model} is not a ds2 low-bit checkpoint (ds2 quantize makes one)")
    stored = StoredExperts(source.config, source.stored, source.tensors)
    if not stored.read_bytes:
        sys.exit(f"error: {args.model} has no routed experts")
    k = 0
    for direct in (False, True):
        for threads in (int(t) for t in args.threads.split(",")):
            gb_per_s, was_direct = rate(source.config, stored, direct, args.reads, threads, args.seed + k)
            k += 1
            how = "buffered" if not direct else "O_DIRECT" if was_direct else "O_DIRECT refused, buffered"
            print(f"{how}, {threads} thread{'s' * (threads > 1)}: {gb_per_s:.2f} GB/s "
                  f"({args.reads} experts, {human_bytes(args.reads * stored.read_bytes)} read)", flush=True)


if __name__ == "__main__":
    main()
