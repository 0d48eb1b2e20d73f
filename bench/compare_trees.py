"""Compare two checkouts of multihead (e.g. before and after a change) on the bench
workloads: rounds alternate between the two trees, each round a fresh process that
times torch.nn.MultiheadAttention, SDPA + 4 Linear and multihead interleaved (the
bench's own timing), so each tree's figure is a ratio to torch.nn measured beside it; the table is written to
--out (bench/results/<the change>_before_after.md) with the command that made it.

    .venv/bin/python bench/compare_trees.py --before /tmp/before --after . --workloads W1,W2 --rounds 3
        --out bench/results/my_change_before_after.md --title "My change: W1 and W2 before and after"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

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
    ap.add_argument("--out", required=True, help="the results file: bench/results/<the change>_before_after.md")
    ap.add_argument("--title", default="Before and after", help="the results file's heading")
    a = ap.parse_args()
    ratios: dict = {}
    for i in range(a.rounds):
        for name, tree in (("before", a.before), ("after", a.after)) if i % 2 == 0 else (("after", a.after),
                                                                                           ("before", a.before)):
            for wl, peer, mode, ms, ratio in run(tree, a.workloads, a.reps):
                ratios.setdefault((wl, mode, peer, name), []).append((ratio, ms))
    lines = [f"# {a.title}", "", f"Made by `.venv/bin/python bench/compare_trees.py {' '.join(sys.argv[1:])}`: rounds "
             "alternate between the two trees, each a fresh process timing torch.nn, SDPA + 4 Linear and multihead "
             f"interleaved ({a.reps} calls each, median); figures are ratios to torch.nn.MultiheadAttention measured in "
             f"the same process, median over {a.rounds} rounds (min-max).", "",
             "| workload | mode | peer | before (x torch.nn) | after (x torch.nn) | after / before |",
             "|---|---|---|---:|---:|---:|"]
    keys = sorted({k[:3] for k in ratios})
    for wl, mode, peer in keys:
        b = [r for r, _ in ratios.get((wl, mode, peer, "before"), [])]
        f = [r for r, _ in ratios.get((wl, mode, peer, "after"), [])]
        if not b or not f:
            continue
        mb, mf = statistics.median(b), statistics.median(f)
        lines.append(f"| {wl} | {mode} | {peer} | {mb:.3f} ({min(b):.3f}-{max(b):.3f}) | {mf:.3f} ({min(f):.3f}-"
                     f"{max(f):.3f}) | {mf / mb:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
