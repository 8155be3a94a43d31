"""The logits a tree's default executor gives on every reference case (tests/data/reference and
reference_v3), as stored in its own file, or held against another tree's: whether a change kept
the same bits. Each case runs as a prompt in one pass, then its last tokens again as decode steps
after the rest, in float32 and quantized at load to 8 and 4 bits (the helper processes' path).

    PYTHONPATH=A python bench/same_bits.py save A.npz [CASE...]
    PYTHONPATH=B python bench/same_bits.py compare A.npz [CASE...]

CASE: only the cases of these names (ds2_tiny_chat, moonlight_like, ...); default every one.
"""

import sys
from pathlib import Path

import numpy as np

import ds2cli

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def cases(names: list[str]):
    for root in ("reference", "reference_v3"):
        for case in sorted((DATA / root).iterdir()):
            if (case / "ref.npz").is_file() and (not names or case.name in names):
                yield case


def model_dir(case: Path):
    if (case / "model").is_dir():
        return case / "model"
    return case if (case / "config.json").is_file() else None      # None: ds2-tiny


def logits(names: list[str]) -> dict:
    out = {}
    for case in cases(names):
        ids = np.load(case / "ref.npz")["ids"]
        for bits in (None, 8, 4):
            model = ds2cli.load(model_dir(case), quantize=bits)
            cut = max(1, len(ids) - 4)
            out[f"{case.name}/{bits}/prefill"] = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
            cache = model.new_cache(len(ids))
            model.forward(ids[:cut], cache)
            out[f"{case.name}/{bits}/decode"] = np.stack([model.forward(ids[t:t + 1], cache) for t in range(cut, len(ids))])
            model.executor.stop()
    return out


def main() -> None:
    what, path, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    got = logits(names)
    if not got:
        sys.exit(f"error: no reference case named {', '.join(names)}")
    if what == "save":
        np.savez(path, **got)
        return
    want = np.load(path)
    same = [k for k in got if np.array_equal(got[k], want[k])]
    for k in got:
        if k not in same:
            print(f"{k}: max |diff| {np.abs(got[k] - want[k]).max():.3e}")
    print(f"{len(same)} of {len(got)} the same bits")


if __name__ == "__main__":
    main()
