"""The benchmark harness runs and reports (timings are not asserted: they live in the benchmark)."""

from __future__ import annotations

import json

from multihead.apps.cli import main


def test_bench_w1_writes_markdown_json_and_chart(tmp_path, capsys):
    assert main(["bench", "--workloads", "W1", "--reps", "2", "--peers", "torch.nn.MHA,SDPA+4 Linear,course code,multihead",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    peers = {(r["peer"], r["mode"]) for r in data["results"]}
    assert ("multihead", "fwd") in peers and ("course code", "fwd+bwd") in peers
    ref = [r for r in data["results"] if r["peer"] == "torch.nn.MHA"]
    assert all(abs(r["ratio"] - 1.0) < 1e-9 for r in ref)
    assert data["machine"]["matmul_gflops"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| W1 | fwd | multihead |" in md and "dense, sdpa" in md
    assert (tmp_path / "bench.png").stat().st_size > 1000
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("| workload | mode | torch.nn.MHA |") and "(1.00x)" in summary
