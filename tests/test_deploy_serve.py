"""The file to serve (multihead.deploy.serve): chosen from each form's times, at a batch size or by the geometric
mean over the sizes timed; a batch size that is no positive whole number refused naming the fix."""

from __future__ import annotations

import math
import re

import pytest

from multihead.deploy import serve

#: three forms whose order changes with the batch size: fused attention wins at batch 1, the plain graph at 64
TIMES = {"onnx_int8": {1: 5.0, 16: 40.0, 64: 150.0}, "onnx_eager_int8": {1: 4.0, 16: 36.0, 64: 160.0},
         "onnx_optimized_int8": {1: 3.0, 16: 42.0, 64: 200.0}}


def test_the_file_to_serve_is_the_fastest_at_the_batch_named_or_by_the_geometric_mean():
    fastest = {B: min(TIMES, key=lambda k: TIMES[k][B]) for B in (1, 16, 64)}
    assert fastest == {1: "onnx_optimized_int8", 16: "onnx_eager_int8", 64: "onnx_int8"}
    for B in (1, 16, 64):
        got = serve.choose(TIMES, B)
        assert got["key"] == fastest[B] and got["chosen_by"] == f"the fastest at batch {B}" and got["fastest"] == fastest
    assert serve.choose(TIMES, 8)["key"] == fastest[16]  # the nearest timed size at or above it
    assert serve.choose(TIMES, 500)["key"] == fastest[64]  # past the largest: the largest
    mean = {k: sum(math.log(v) for v in t.values()) for k, t in TIMES.items()}
    got = serve.choose(TIMES)
    assert got["key"] == min(mean, key=mean.get) and got["chosen_by"] == "the best geometric mean over batch 1, 16, 64"


def test_the_runtime_table_rows_give_the_same_times():
    rows = [{"runtime": "ONNX Runtime int8", "batch": B, "forms": {k: {"median_ms": t[B]} for k, t in TIMES.items()}}
            for B in (1, 16, 64)]
    assert serve.from_rows(rows) == {"ONNX Runtime int8": TIMES}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "16", True])
def test_a_serve_batch_that_is_no_positive_whole_number_is_refused(bad):
    with pytest.raises(ValueError, match=rf"serve_batch must be a positive whole number \(the batch size served, "
                                         rf"e.g. 16\) or None .*; got {re.escape(repr(bad))}"):
        serve.check_serve_batch(bad)
    assert serve.check_serve_batch(16) == 16 and serve.check_serve_batch(None) is None
