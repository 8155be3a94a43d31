"""What one widened weight block costs a pass of k tokens, by every product NumPy offers.

A batched decode pass (continuous batching, `ds2 serve --parallel`) multiplies each shared
weight by k rows. The int8 block is widened once into float32; then either k gemvs, or one
sgemm in either orientation. This times each on one core, in microseconds per 256K weights
(one 128 x 2048 block), min of the repeats:

    python examples/few_rows_kernel.py [--rows 128] [--inp 2048] [--repeats 30]

On the 2-core EPYC of the README (OpenBLAS 0.3.31, Haswell kernels) the cast takes ~37 us and
each extra gemv ~18 us, and no sgemm beats k gemvs up to k = 4: a pass of 4 tokens costs
about 2x one token on the shared weights, which is what bounds 4 streams to ~1.4x one stream.
"""

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128, help="rows of a widened block (ds2: L2-sized)")
    ap.add_argument("--inp", type=int, default=2048)
    ap.add_argument("--out", type=int, default=1408, help="rows of the whole matrix")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    threadpool_limits(1)
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (args.out, args.inp), dtype=np.int8)
    R = args.rows
    buf = np.empty((R, args.inp), np.float32)
    per = args.out * args.inp / 262144                     # 256K-weight units in the matrix

    def run(k: int, how: str) -> float:
        x = rng.standard_normal((k, args.inp)).astype(np.float32)
        xt = np.ascontiguousarray(x.T)
        y = np.empty((k, args.out), np.float32)
        yt = np.empty((R, k), np.float32)

        def once():
            for r0 in range(0, args.out - R + 1, R):
                np.copyto(buf, q[r0:r0 + R], casting="unsafe")
                if how == "gemvs":
                    for t in range(k):
                        np.dot(buf, x[t], out=y[t, r0:r0 + R])
                elif how == "W @ x.T":
                    np.matmul(buf, xt, out=yt)
                elif how == "x @ W.T":
                    np.matmul(x, buf.T, out=y[:, r0:r0 + R])
        return best_of(once, args.repeats) * 1e6 / per

    cast = run(1, "cast only")
    print(f"int8 -> float32 cast alone: {cast:.1f} us per 256K weights")
    print(f"{'k':>3} {'k gemvs':>9} {'W @ x.T':>9} {'x @ W.T':>9}   (us per 256K weights, cast included)")
    one = None
    for k in (1, 2, 3, 4, 8):
        row = {how: run(k, how) for how in ("gemvs", "W @ x.T", "x @ W.T")}
        best = min(row.values())
        one = one or best
        print(f"{k:>3} {row['gemvs']:9.1f} {row['W @ x.T']:9.1f} {row['x @ W.T']:9.1f}   best {best / one:.2f}x one token")


if __name__ == "__main__":
    main()
