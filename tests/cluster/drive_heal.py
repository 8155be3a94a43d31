"""A driver the healing test runs inside the namespace: ds2-tiny over the cluster at ADDRESS,
spread by SPREAD (layers, the default, or experts); the ids of IDS.npy in two caches (one fed a
prompt then decode steps, one a shorter prompt); after the first HALF decode steps it writes
READY and waits (at most 120 s) for GO, while the test kills a node; then the remaining steps,
and one more pass on the second cache. Every step's logits, the placement's lines before and
after, what healing said and its counts go to OUT.npz.
Usage: drive_heal.py ADDRESS OUT IDS.npy PROMPT HALF READY GO [SPREAD]"""

import json
import sys
import time
from pathlib import Path

import numpy as np

from ds2cli.execution.factory import cluster_model
from ds2cli.weights.source import open_model


def main(address: str, out: str, ids_file: str, prompt: int, half: int, ready: str, go: str,
         spread: str = "layers") -> None:
    ids = np.load(ids_file)
    said: list[str] = []
    model = cluster_model(open_model(None), address, show=said.append, spread=spread)
    passes = model.executor.passes
    before = passes.placement.lines(model.config.num_hidden_layers)
    a, b = model.new_cache(len(ids)), model.new_cache(len(ids))
    rows = [model.forward(ids[:prompt], a, all_logits=True)]
    model.forward(ids[:prompt // 2], b)
    for t in range(prompt, prompt + half):
        rows.append(model.forward(ids[t:t + 1], a, all_logits=True))
    Path(ready).touch()
    deadline = time.monotonic() + 120
    while not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    for t in range(prompt + half, len(ids)):
        rows.append(model.forward(ids[t:t + 1], a, all_logits=True))
    second = model.forward(ids[prompt // 2:prompt], b, all_logits=True)
    np.savez(out, logits=np.concatenate(rows), second=second, said=np.array("\n".join(said)),
             before=np.array("\n".join(before)),
             after=np.array("\n".join(passes.placement.lines(model.config.num_hidden_layers))),
             healed=np.array(json.dumps(passes.healed)), stages=np.array(len(passes.stages)))
    model.executor.stop()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5], a[6], *a[7:8])
