"""What coordinating the helper processes costs this process a plan (execution/helpers.py).

One product of one unit (a q8 matrix of --rows x --inp, fewer weights than plans.UNIT_MIN_VALUES,
so whoever takes the unit runs the whole product) goes --plans times as a plan of its own to
0, 1, ... --helpers helper processes, each count with helpers forked for it; beside it, the same
product run alone on this thread. Per plan, medians in us: the plan, the plan less the product
alone (the coordination: the cut, writing the plan, the claims, the wait, the rows copied back),
`Helpers.send` alone (each taking helper's x and tables written into its memory, the claim
tokens and its PLAN message), and the share of units a helper ran. With 0 helpers taking part
the unit runs here with no message sent: what a pass does on a busy machine (load.py). Past this
machine's cores the helpers share them with this process, and only the send is worth reading.

    python bench/plan_cost.py [--plans 400] [--rows 384] [--inp 1024] [--helpers 3]
"""

import argparse
import statistics
import time

import numpy as np

from ds2cli.execution.cores import Blas, Workers, allowed_cores
from ds2cli.execution.helpers import Helpers
from ds2cli.execution.plans import Registry
from ds2cli.model.linear import Rows
from ds2cli.weights import formats, scales


class FreeCores:
    """A load reading (load.Load's `free`) that finds `n` cores free, whatever else runs."""

    def __init__(self, n: int):
        self.n = n

    def free(self, most: int, own_pids=()) -> int:
        return min(most, self.n)


def us(seconds: list[float]) -> float:
    return 1e6 * statistics.median(seconds)


def product_alone(m, x: np.ndarray, plans: int) -> list[float]:
    y = np.empty(m.shape[0], np.float32)
    out = []
    with Blas().threads(1):
        for _ in range(plans + 1):
            t0 = time.perf_counter()
            m.span(x, y, 0, m.shape[0])
            out.append(time.perf_counter() - t0)
    return out[1:]


def plans_with(m, x: np.ndarray, taking: int, plans: int) -> tuple[list[float], list[float], float]:
    """Each plan's seconds and its send's, with `taking` helpers taking part (at least one forked,
    so that with none taking part the plan is still cut and its unit run as the helpers' path
    runs it), and the share of units they ran."""
    registry = Registry()
    registry.add(m)
    workers = Workers(taking + 1, load=FreeCores(taking + 1), blas=Blas())
    helpers = workers.helpers = Helpers(max(1, taking), registry, workers)
    helpers.plan_min_values = 0            # this one-unit plan too is sent (it is what is timed)
    sends, send = [], helpers.send

    def timed_send(*args):
        t0 = time.perf_counter()
        ready = send(*args)
        sends.append(time.perf_counter() - t0)
        return ready
    helpers.send = timed_send               # this object's own send, timed
    y = np.empty(m.shape[0], np.float32)
    times = []
    try:
        with workers.forward_pass(low_bit=True, tokens=1, helpers_wanted=True):
            for _ in range(plans + 1):
                product = Rows(m, x, y, 8)
                t0 = time.perf_counter()
                left = helpers.run([product])
                times.append(time.perf_counter() - t0)
                if left or len(product.spans) != 1:
                    raise SystemExit(f"error: the product was not one unit of a plan ({len(product.spans)} spans)")
    finally:
        helpers.stop()
        if workers.pool is not None:
            workers.pool.shutdown()
    return times[1:], sends[1:], helpers.helper_units / max(1, helpers.units)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=400)
    ap.add_argument("--rows", type=int, default=384)
    ap.add_argument("--inp", type=int, default=1024)
    ap.add_argument("--helpers", type=int, default=3, help="the most helpers taking part (default: 3)")
    args = ap.parse_args()
    w = np.random.default_rng(0).standard_normal((args.rows, args.inp), dtype=np.float32)
    m = scales.quantize_matrix(w, formats.FORMATS["q8"])
    x = np.random.default_rng(1).standard_normal(args.inp, dtype=np.float32)
    alone = us(product_alone(m, x, args.plans))
    print(f"a {args.rows}x{args.inp} q8 product, {args.plans} plans, {allowed_cores()} cores here: "
          f"the product alone {alone:.1f} us")
    print("helpers taking part   plan us   coordination us   send us   units by helpers")
    for taking in range(args.helpers + 1):
        times, sends, share = plans_with(m, x, taking, args.plans)
        print(f"{taking:>19}   {us(times):>7.1f}   {us(times) - alone:>15.1f}   "
              f"{us(sends):>7.1f}   {100 * share:>15.0f}%")


if __name__ == "__main__":
    main()
