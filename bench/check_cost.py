"""What checking streamed experts against their checksums costs decode: the same ds2 low-bit
checkpoint with and without the checksums `ds2 quantize` records (weights/checksums.py), each
run as `ds2 generate --memory-budget BUDGET --json` (the page cache dropped before each run unless
DROP_CACHES=0), alternating --pairs times; decode tok/s min / median / max and checked over
unchecked. A streamed run hashes an expert on its first read in the process only, so the cost is
the first reads' (a short run pays it most).

The two checkpoints are made in OUT_DIR from MODEL without copying a weight: `checked` and
`unchecked` hold symbolic links to MODEL's shards and files and an index of their own, with the
checksums of MODEL's stored bytes (computed here, read by memory map) or without any.

    python bench/check_cost.py MODEL OUT_DIR [--budget 11G] [--tokens 16] [--pairs 2] [--prompt TEXT]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds2cli.weights import checkpoint, checksums, qcheckpoint

INDEX = checkpoint.INDEX_NAME


def linked(model: Path, out: Path, sums: dict | None) -> Path:
    """`out`: MODEL's files linked, its index written with `sums` (None: none recorded)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != INDEX and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    index = json.loads((model / INDEX).read_text())
    index.pop("checksums", None)
    if sums is not None:
        index["checksums"] = checksums.index_record(sums)
    (out / INDEX).write_text(json.dumps(index))
    return out


def stored_sums(model: Path) -> dict:
    """Every tensor's checksum as quantize records it, from the stored bytes."""
    sums = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, t in checkpoint.read_header(shard).items():
            raw = np.memmap(t.file, np.uint8, "r", t.offset, (t.nbytes,))
            if qcheckpoint.is_expert_stack(name):
                per = t.nbytes // t.shape[0]
                sums[name] = [checksums.digest(memoryview(raw[e * per:(e + 1) * per])) for e in range(t.shape[0])]
            else:
                sums[name] = checksums.digest(memoryview(raw))
    return sums


def run(model: Path, args) -> float:
    if os.environ.get("DROP_CACHES", "1") != "0":
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "-m", str(model), args.prompt, "-n",
                        str(args.tokens), "--temperature", "0", "--ignore-eos", "--memory-budget", args.budget,
                        "--json"], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"error: {model}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout)["timings"]["decode_tok_per_s"]


def spread(v: list[float]) -> str:
    return f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", default="11G")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    checked = linked(args.model, args.out / "checked", stored_sums(args.model))
    unchecked = linked(args.model, args.out / "unchecked", None)
    got = {"checked": [], "unchecked": []}
    for k in range(args.pairs):
        for side in (("checked", "unchecked") if k % 2 == 0 else ("unchecked", "checked")):
            got[side].append(run(checked if side == "checked" else unchecked, args))
            print(f"pair {k + 1} {side}: {got[side][-1]} tok/s", file=sys.stderr)
    ratios = [c / u for c, u in zip(got["checked"], got["unchecked"])]
    print(f"{args.pairs} pairs, {args.tokens} tokens, --memory-budget {args.budget}: decode tok/s min / median / max")
    print(f"checked {spread(got['checked'])}  unchecked {spread(got['unchecked'])}  "
          f"checked/unchecked median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
