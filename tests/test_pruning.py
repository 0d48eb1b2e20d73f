"""Pruning end to end: the toy model through `multihead prune`, and the pretrained MiniLM."""

from __future__ import annotations

import json

import pytest
import torch

from multihead import heads
from multihead.apps.cli import main
from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, checkpoint


def test_prune_toy_writes_report_curve_and_a_loadable_model(trained, tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["prune", "--model", "toy", "--fraction", "0.25", "--step", "0.125", "--checkpoints",
                 str(trained["dir"] / "transformer"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    curve = report["curve"]
    assert [r["heads_pruned"] for r in curve] == [0, 3, 6]  # 24 heads, steps of 12.5%
    assert all(set(r["speed_ms"]) == {"1", "16", "64"} for r in curve)
    assert curve[0]["metric"] >= 0.95
    for name in ("importance.png", "curve.png", "report.md", "curve.json"):
        assert (out / name).stat().st_size > 200, name
    model = checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, out / "model")
    n_heads = sum(m.num_heads for m in heads.attention_modules(model).values())
    assert n_heads == 24 - 6
    from multihead.models.seq2seq import digit_accuracy

    assert abs(digit_accuracy(model) - report["final"]["metric"]) < 1e-9  # the saved model is the measured one
    assert "25% of heads pruned" in text and "| batch 1 (ms) |" in text


def _minilm():
    pytest.importorskip("tokenizers")
    from multihead.models import SentenceEncoder, minilm_path

    try:
        return SentenceEncoder.from_pretrained(minilm_path()).eval()
    except FileNotFoundError:
        pytest.skip("the pretrained MiniLM package is not installed")


def test_minilm_pruned_equals_gated_and_reloads(tmp_path):
    from multihead.apps.data import sentences
    from multihead.models import Bert

    enc = _minilm()
    ids, am = enc.tokenize(sentences(24))
    remove = {"layers.0.attn": [0, 5], "layers.3.attn": list(range(12)), "layers.5.attn": [11]}
    gates = {}
    for n, hs in remove.items():
        g = torch.ones(12)
        g[hs] = 0
        gates[n] = g
    with torch.no_grad(), heads.gated(enc.bert, gates):
        expected = enc(ids, am)
    heads.prune(enc.bert, remove)
    with torch.no_grad():
        got = enc(ids, am)
    assert (got - expected).abs().max() < 1e-5
    enc.bert.save_pretrained(tmp_path)
    again = Bert.from_pretrained(tmp_path)
    assert [layer.attn.num_heads for layer in again.layers] == [10, 12, 12, 0, 12, 11]
    with torch.no_grad():
        assert torch.allclose(again(ids, am), enc.bert(ids, am), atol=1e-6)
