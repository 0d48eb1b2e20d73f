"""multihead.deploy.compare: the arithmetic bound's work count against the layer arithmetic written out, and the
recommendation read from timed rows."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
import multihead.hf as mhf  # noqa: E402
from multihead import heads  # noqa: E402
from multihead.deploy import compare  # noqa: E402

T = transformers


def _flops(B: int, L: int, E: int, F: int, heads_per_layer: list[int], D: int) -> int:
    """A BERT encoder's padded call written out: per layer q, k, v (E -> H·D), o (H·D -> E), the feed-forward
    (E -> F -> E), the scores and weighted sum (2·B·H·L·L·2D); the pooler (E -> E on one token)."""
    total = 0
    for H in heads_per_layer:
        total += 2 * B * L * E * H * D * 4 + 2 * B * L * E * F * 2 + 2 * B * H * L * L * 2 * D
    return total + 2 * B * E * E


@pytest.mark.parametrize("packed", [False, True])
def test_work_is_the_padded_calls_arithmetic(packed):
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64)
    model = mhf.attach(T.BertModel(cfg).eval(), packed=packed)
    ids, am = torch.randint(3, 100, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    am[1, 3:] = 0  # padding: the runtimes compute it, so it counts
    batch = {"input_ids": ids, "attention_mask": am}
    assert compare.work(model, batch) == _flops(2, 9, 32, 64, [4, 4], 8)
    heads.prune(model, {"encoder.layer.0.attention.self": [1, 3]})
    assert compare.work(model, batch) == _flops(2, 9, 32, 64, [2, 4], 8)


def test_the_recommendation_is_the_fastest_row_that_keeps_the_fidelity():
    rows = [{"peer": "a", "cosine": 1.0, "ms_per_batch": {"median_ms": 10.0}},
            {"peer": "b", "cosine": 0.93, "ms_per_batch": {"median_ms": 4.0}},  # faster, but below the fidelity
            {"peer": "c", "cosine": 0.97, "ms_per_batch": {"median_ms": 5.0}}]
    assert compare.recommend(rows, min_cosine=0.95) == ("fastest at mean cosine >= 0.95: c (5.0 ms, cosine 0.9700, "
                                                        "2.00x ahead of a)")
    assert compare.recommend(rows, min_cosine=0.999) == "fastest at mean cosine >= 0.999: a (10.0 ms, cosine 1.0000)"
    assert compare.recommend(rows, min_cosine=1.5) is None
