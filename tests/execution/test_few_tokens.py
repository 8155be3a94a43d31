"""The few-token kernel (a format's span_gemv / span_gemm): a low-bit matrix times k = 2..64
activation rows, L2-sized row blocks widened once for all k rows, split across the cores by the
executor (the helper processes included). Checked against float64 products of the dequantized weights, within
a float32 rounding bound: the kernel and the reference use different BLAS call shapes."""

import numpy as np
import pytest

import sys

from ds2cli.execution.compute import CoreCompute
from ds2cli.execution.machine import Machine
from ds2cli.model.linear import FEW_TOKENS
from ds2cli.weights import scales
from ds2cli.weights.formats import FORMATS, QuantMatrix
from support.machines import quiet_machine

EPS = np.finfo(np.float32).eps


MACHINE = Machine(helpers=False)
ONE_CORE = Machine(threads=1)


def split(m, x: np.ndarray, machine: Machine = MACHINE) -> np.ndarray:
    """m's product with x, its rows cut over the machine's cores (and, in a low-bit few-token
    pass, its helper processes) by the compute part."""
    return CoreCompute(machine).matmul_all([(m, x)])[0]


def assert_product(m: QuantMatrix, x: np.ndarray, y: np.ndarray) -> None:
    """|y - x.W^T| within n.eps.(|x|.|W|^T) per entry (the standard bound for a float32 dot
    product of length n, with the dequantization's own rounding counted in)."""
    w = m.dequantize().astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    bound = (x.shape[1] + 2) * EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert (np.abs(y - ref) <= bound).all(), float((np.abs(y - ref) / np.maximum(bound, 1e-30)).max())


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [(name, shape) for name in ["q8", "q4", "q8b", "bf16"]
                                         for shape in [(2816, 2048), (1000, 514), (520, 96), (33, 64), (4097, 130)]
                                         if FORMATS[name].supports(shape)])   # q8b: rows of whole 32-blocks
@pytest.mark.parametrize("k", [2, 3, 7, 16, 33, 64])
def test_the_few_token_kernel_is_the_product_of_the_dequantized_weights(name, shape, k):
    rng = np.random.default_rng(k * 1000 + shape[0])
    m = scales.quantize_matrix(rng.standard_normal(shape, dtype=np.float32), FORMATS[name])
    m.small_matrix = 0                                        # every matrix through the kernel
    x = rng.standard_normal((k, shape[1]), dtype=np.float32)
    assert_product(m, x, m.matmul(x))
    assert_product(m, x, split(m, x))


@pytest.mark.parametrize("name", ["q8", "q4", "q8b", "bf16"])
def test_small_row_blocks_and_odd_spans(name):
    """Blocks much smaller than the matrix, and partial last groups, at every k."""
    rng = np.random.default_rng(3)
    m = scales.quantize_matrix(rng.standard_normal((1003, 320), dtype=np.float32), FORMATS[name])
    m.small_matrix, m.l2_block_bytes = 0, 40 * 4 * 320
    for k in range(2, 65, 9):
        x = rng.standard_normal((k, 320), dtype=np.float32)
        assert_product(m, x, split(m, x))
        assert_product(m, x, split(m, x, ONE_CORE))


@pytest.mark.skipif(not Machine(helpers=True).helpers_allowed or sys.platform != "linux",
                    reason="helper processes: Linux, two cores or more")
@pytest.mark.parametrize("name", ["q8", "q4", "q8b", "bf16"])
def test_the_helper_processes_take_their_rows_of_a_few_token_pass(name):
    """In a pass of few tokens the products are split with the helper processes, whose shared
    memory holds k rows of x and y; the result is the same product."""
    rng = np.random.default_rng(5)
    m = scales.quantize_matrix(rng.standard_normal((1536, 512), dtype=np.float32), FORMATS[name])
    m.small_matrix = 0
    machine = quiet_machine()
    machine.register([m])
    machine.start_helpers()
    try:
        helpers = machine.helpers
        assert helpers is not None
        helpers.plan_min_values = 0                           # a two-token plan of 1.6M too
        for k in (2, 5, 64):
            x = rng.standard_normal((k, 512), dtype=np.float32)
            sent = helpers.seq
            with machine.forward_pass(low_bit=True, tokens=k):
                y = split(m, x, machine)
            assert helpers.seq > sent                         # the helpers did take part
            assert_product(m, x, y)
        x = rng.standard_normal((FEW_TOKENS + 1, 512), dtype=np.float32)
        sent = helpers.seq
        with machine.forward_pass(low_bit=True, tokens=len(x)):
            y = m.matmul(x)                                   # a prefill: threads, not helpers
        assert helpers.seq == sent
        assert_product(m, x, y)
    finally:
        machine.stop_helpers()
