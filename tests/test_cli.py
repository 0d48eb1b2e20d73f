"""The `multihead` command."""

from __future__ import annotations

import re

from multihead.cli import format_weights, main


def test_demo_prints_shape_dispatch_and_weights(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "output shape: (2, 4, 100)" in out
    assert "runs: sdpa" in out and "reference" in out
    # the weights grid of sequence 1 (valid length 2): rows sum to 1, keys 2.. get 0
    rows = [line.split()[1:] for line in out.splitlines() if re.match(r"^q\d ", line)]
    assert len(rows) == 4
    for row in rows:
        values = [float(x) for x in row]
        assert values[2:] == [0.0] * 4
        assert abs(sum(values) - 1.0) < 0.011


def test_format_weights_grid():
    import torch

    s = format_weights(torch.tensor([[0.25, 0.75], [1.0, 0.0]]))
    assert s.splitlines()[1].split() == ["q0", "0.25", "0.75"]
    assert s.splitlines()[0].split() == ["k0", "k1"]
