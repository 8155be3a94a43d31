"""The examples stay runnable, and the arithmetic check really is near 100%."""

import re
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name, *args):
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_arithmetic_accuracy_of_bundled_model():
    out = run("arithmetic.py", "--n", "100", "--seed", "0")
    correct = int(re.search(r"accuracy: (\d+)/100", out).group(1))
    assert correct >= 98, out


def test_stream_prints_a_greedy_continuation():
    out = run("stream.py", "ROMEO:\n", "--max-new-tokens", "20")
    assert out.startswith("ROMEO:\n") and len(out) > len("ROMEO:\n") + 10


def test_score_reports_perplexity_consistent_with_log_probs():
    out = run("score.py", "What is 2 + 2?")
    lps = [float(line.split()[0]) for line in out.splitlines()[:-1]]
    summary = re.search(r"tokens (\d+)\s+mean log-prob (-?[\d.]+)\s+perplexity ([\d.]+)", out)
    assert int(summary.group(1)) == len(lps) and all(lp <= 0 for lp in lps)
    mean = sum(lps) / len(lps)
    assert abs(float(summary.group(2)) - mean) < 1e-3
    assert abs(float(summary.group(3)) - 2.718281828 ** -mean) / float(summary.group(3)) < 1e-2


def test_quant_quality_reports_kl_and_agreement_on_a_reference_case():
    out = run("quant_quality.py", "--bits", "8", "--model", str(EXAMPLES.parent / "tests/data/reference/lite_like_plainq_yarn"))
    m = re.search(r"over (\d+) positions: mean KL ([\d.e-]+), top-1 agreement ([\d.]+)%", out)
    assert int(m.group(1)) == 220 and 0 < float(m.group(2)) < 1e-2 and float(m.group(3)) > 80, out


def test_few_rows_kernel_times_every_product():
    out = run("few_rows_kernel.py", "--rows", "32", "--inp", "256", "--out", "128", "--repeats", "2")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 8]
    assert rows[0][5] == "1.00x" and all(float(v) > 0 for r in rows for v in r[1:4])


def test_side_by_side_reports_both_phases_and_their_ratios():
    tiny = str(EXAMPLES.parent / "ds2cli/models/ds2-tiny")
    out = run("side_by_side.py", tiny, tiny, "--rounds", "3", "--prompt", "8", "--decode", "4")
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert out.startswith("2 rounds") and set(lines) == {"prefill", "decode"}
    for phase, row in lines.items():
        # "A min / med / max   B min / med / max   B/A min / med / max"
        values = [float(v) for v in row[2:13:2] + row[14::2]]
        assert len(values) == 9 and all(v > 0 for v in values), out
        assert values[0] <= values[1] <= values[2] and values[6] <= values[7] <= values[8], out
