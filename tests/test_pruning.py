"""Pruning end to end: the toy model through `multihead prune`, and the pretrained MiniLM."""

from __future__ import annotations

import json

import pytest
import torch

from multihead import heads
from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, checkpoint
from multihead_cli import main


def test_prune_toy_writes_report_curve_and_a_loadable_model(trained, tmp_path, capsys):
    """`prune --model toy --recover N`: every step of the curve fine-tuned N steps (the curve with and without it),
    the kept model the recovered one, saved and measured as the report says; the speed table and the bound."""
    out = tmp_path / "p"
    assert main(["prune", "--model", "toy", "--fraction", "0.25", "--step", "0.125", "--recover", "10", "--checkpoints",
                 str(trained["dir"] / "transformer"), "--out", str(out), "--max-seconds", "0.3"]) == 0
    text = capsys.readouterr().out
    assert f"transformer: loaded {trained['dir'] / 'transformer'}" in text  # the given checkpoint, not retrained
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
    assert [r["recovery"]["steps"] for r in curve[1:]] == [10, 10] and curve[0]["metric_recovered"] == curve[0]["metric"]
    assert report["final"]["metric"] == curve[-1]["metric_recovered"] == report["recovery"]["metric_after"]
    assert "| after recovery |" in (out / "report.md").read_text() and set(report["bound"]) == {"1", "16", "64"}
    assert all(1.0 < v < 2.0 for v in report["bound"].values())  # a quarter of the heads: some work, never half
    assert "| bound: the arithmetic removed |" in text  # under the speed-ups, in the same columns
    assert "Recovery: 10 fine-tuning steps on the reversal task" in (out / "report.md").read_text()
    assert "25% of heads pruned" in text and "| batch 1: ms (min-max) |" in text
    # the speed table: every model timed together, medians with their interval and min-max
    for per in report["speed"].values():
        for t in per.values():
            assert t["min_ms"] <= t["ci95_ms"][0] <= t["median_ms"] <= t["ci95_ms"][1] <= t["max_ms"]
            assert t["rounds"] >= 3  # the command runs under its time budget: 3 rounds at least (7 without one)


def test_a_recovery_past_the_time_budget_is_refused_before_any_work(trained, tmp_path, capsys):
    """`prune --model toy --recover N` whose recovery after every step cannot fit --time-budget: the plan, costed
    before any work, says so in one line, exit 2."""
    assert main(["prune", "--model", "toy", "--recover", "100000", "--time-budget", "40s", "--checkpoints",
                 str(trained["dir"] / "transformer"), "--out", str(tmp_path / "late")]) == 2
    err = capsys.readouterr().err.strip()
    err = [ln for ln in err.splitlines() if ln.startswith("multihead prune:")]  # not the progress lines
    assert len(err) == 1 and err[0].startswith("multihead prune: --time-budget 40s cannot hold one candidate: about ")
    assert "recovering the curve" in err[0] and err[0].endswith("or fewer --recover steps")
    assert not (tmp_path / "late" / "report.json").exists()


def test_prune_toy_saved_model_equals_the_one_in_memory(trained, tmp_path):
    from multihead.apps.prune import pruning
    from multihead.models.seq2seq import reverse_batch

    setup = pruning.toy_setup(trained["dir"] / "transformer")
    pruning.run(setup, tmp_path, pruning.Options(0.125, step=0.125, progress=False, max_seconds=0.3))
    loaded = checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, tmp_path / "model")  # the documented call
    src, lens, tgt_in, _ = reverse_batch(16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(src, lens, tgt_in), setup.pruned(src, lens, tgt_in))


def test_demo_checkpoints_load_back(trained):
    """The checkpoints the demo writes (and reuses) load with the documented call and equal the trained models."""
    from multihead.models import ViT, ViTConfig, digits
    from multihead.models.seq2seq import reverse_batch

    rev = checkpoint.load(Seq2SeqTransformer, Seq2SeqConfig, trained["dir"] / "transformer")
    src, lens, tgt_in, _ = reverse_batch(8, generator=torch.Generator().manual_seed(1))
    vit = checkpoint.load(ViT, ViTConfig, trained["dir"] / "vit")
    x = digits()[2][:8]
    with torch.no_grad():
        assert torch.equal(rev(src, lens, tgt_in), trained["reverser"].eval()(src, lens, tgt_in))
        assert torch.equal(vit(x), trained["vit"].eval()(x))


def _minilm():
    pytest.importorskip("tokenizers")
    from multihead.models import SentenceEncoder, minilm_path

    try:
        return SentenceEncoder.from_pretrained(minilm_path()).eval()
    except FileNotFoundError:
        pytest.skip("the pretrained MiniLM package is not installed")


def test_minilm_pruned_equals_gated_and_reloads(tmp_path):
    from multihead.apps.common.data import sentences
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


def test_prune_minilm_writes_a_model_that_loads(tmp_path, capsys):
    """`multihead prune --model minilm` (small settings): the pruned model in DIR/model loads with
    Bert.from_pretrained and is the model the command measured and held in memory."""
    _minilm()
    from multihead.apps.prune import pruning
    from multihead.models import Bert, SentenceEncoder

    setup = pruning.minilm_setup(8, 16)
    import time

    # a deadline, as the command line sets one: its speed table runs 3 rounds per batch size, not 7
    report = pruning.run(setup, tmp_path, pruning.Options(0.1, step=0.1, progress=False, max_seconds=0.3,
                                                          deadline=time.monotonic() + 300))
    assert report["final"]["fraction"] > 0.05
    loaded = Bert.from_pretrained(tmp_path / "model")  # the documented call
    assert sum(layer.attn.num_heads for layer in loaded.layers) == 72 - report["curve"][-1]["heads_pruned"]
    enc = SentenceEncoder(loaded, setup.model.tokenizer)
    ids, am = enc.tokenize(["the pruned model loads", "and gives the same embeddings", "as in memory"])
    with torch.no_grad():
        assert torch.allclose(enc(ids, am), setup.pruned(ids, am), atol=1e-6)
    assert abs(setup.metric_fn(enc) - report["final"]["metric"]) < 1e-6  # the saved model is the measured one
    # and through the command line
    out = tmp_path / "cli"
    assert main(["prune", "--model", "minilm", "--fraction", "0.05", "--step", "0.05", "--sentences", "8", "8",
                 "--max-seconds", "0.3", "--out", str(out)]) == 0
    again = Bert.from_pretrained(out / "model")
    cli = json.loads((out / "report.json").read_text())
    assert sum(layer.attn.num_heads for layer in again.layers) == 72 - cli["curve"][-1]["heads_pruned"]
    assert "transformers.BertModel" in cli["speed"] and "report:" in capsys.readouterr().out


def test_the_speed_table_takes_what_the_time_budget_leaves_and_marks_unsettled_medians():
    import time

    from multihead.apps.prune import pruning

    assert pruning._allowed(60.0, None, 3) == (60.0, 7)  # no budget: --max-seconds per batch size, 7 rounds
    seconds, rounds = pruning._allowed(60.0, time.monotonic() + 65.0, 3)  # 60 s left for 3 batch sizes
    assert 19.0 < seconds <= 20.0 and rounds == 3
    assert pruning._allowed(60.0, time.monotonic() - 1.0, 2) == (0.0, 3)  # past the deadline: 3 rounds, no more
    ok = {"median_ms": 10.0, "ci95_ms": [9.8, 10.3], "min_ms": 9.5, "max_ms": 11.0, "rounds": 9}
    loose = {"median_ms": 10.0, "ci95_ms": [8.0, 13.0], "min_ms": 7.0, "max_ms": 15.0, "rounds": 3}
    table = pruning.speed_table({"unpruned": {"1": ok, "16": ok}, "pruned": {"1": ok, "16": loose}})
    assert "| pruned | 10.00 (9.50-11.00) | 10.00 † (7.00-15.00) |" in table
    assert table.endswith("† median not settled to ±5% in the time allowed (its 95% interval is wider): read it as "
                          "a range, see min-max.")
    assert "†" not in pruning.speed_table({"unpruned": {"1": ok}})


def test_prune_keeps_to_its_time_budget(trained, tmp_path, capsys):
    """A deadline spent before the speed table (the plan is an estimate): every batch size still gets 3 rounds, and
    the report says the budget cut the timing short instead of running on. Through the command, a budget that
    cannot hold the work is refused before any (tests/test_pruning_target.py)."""
    import time

    from multihead.apps.prune import pruning

    out = tmp_path / "p"
    setup = pruning.toy_setup(trained["dir"] / "transformer")
    pruning.run(setup, out, pruning.Options(0.125, step=0.125, deadline=time.monotonic() + 1.0, progress=False))
    report = json.loads((out / "report.json").read_text())
    assert all(t["rounds"] >= 3 for per in report["speed"].values() for t in per.values())
    assert any("the time budget left 0 s for this batch size" in n for n in report["timing_notes"])
    assert "the time budget left 0 s" in (out / "report.md").read_text()
