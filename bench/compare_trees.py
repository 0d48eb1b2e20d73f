"""Compare two checkouts of multihead (e.g. before and after a change) on the bench
workloads: rounds alternate between the two trees, each round a fresh process that
times torch.nn.MultiheadAttention, SDPA + 4 Linear and multihead interleaved (the
bench's own timing), so each tree's figure is a ratio to torch.nn measured beside it.

    .venv/bin/python bench/compare_trees.py --before /tmp/before --after . --workloads W1,W2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SNIPPET = """
import json, sys
try:
    from multihead.apps.bench import bench
except ImportError:
    from multihead import bench
peers = ["torch.nn.MHA", "SDPA+4 Linear", "multihead", "multihead (valid_lens)", "multihead (Padding)"]
out = []
for w in bench.workloads(sys.argv[1].split(",")):
    for r in bench.time_workload(w, peers, int(sys.argv[2]), log=lambda *a: None):
        out.append([r.workload, r.peer, r.mode, r.median_ms, r.ratio])
print(json.dumps(out))
"""


def run(tree: str, workloads: str, reps: int) -> list:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    res = subprocess.run([sys.executable, "-c", SNIPPET, workloads, str(reps)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=".")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    ratios: dict = {}
    for i in range(a.rounds):
        for name, tree in (("before", a.before), ("after", a.after)) if i % 2 == 0 else (("after", a.after),
                                                                                           ("before", a.before)):
            for wl, peer, mode, ms, ratio in run(tree, a.workloads, a.reps):
                ratios.setdefault((wl, mode, peer, name), []).append((ratio, ms))
    print("| workload | mode | peer | before (x torch.nn) | after (x torch.nn) | after / before |")
    print("|---|---|---|---:|---:|---:|")
    keys = sorted({k[:3] for k in ratios})
    for wl, mode, peer in keys:
        b = [r for r, _ in ratios.get((wl, mode, peer, "before"), [])]
        f = [r for r, _ in ratios.get((wl, mode, peer, "after"), [])]
        if not b or not f:
            continue
        mb, mf = statistics.median(b), statistics.median(f)
        print(f"| {wl} | {mode} | {peer} | {mb:.3f} ({min(b):.3f}-{max(b):.3f}) | {mf:.3f} ({min(f):.3f}-{max(f):.3f}) "
              f"| {mf / mb:.3f} |")


if __name__ == "__main__":
    main()
