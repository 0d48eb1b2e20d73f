"""The `multihead` command: the demo and viz."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from multihead.apps.demo.demo import format_weights
from multihead_cli import main


def test_demo_prints_and_writes_everything(trained, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(trained["dir"], out / "checkpoints")  # reused, not retrained
    assert main(["demo", "--out", str(out), "--max-seconds", "0.2", "--recover", "10"]) == 0  # speed tables: 7 rounds
    text = capsys.readouterr().out
    assert "output shape: (2, 4, 100)" in text
    assert "- scores divided by d_k [stage: scores]" in text and "- softmax skipped (values times raw scores)" in text
    assert "runs: sdpa" in text and "reference" in text
    assert "transformer: loaded" in text and "ViT: loaded" in text
    rows = [line.split()[1:] for line in text.splitlines() if re.match(r"^q\d ", line)]
    assert len(rows) == 4
    for row in rows:  # sequence 1 (valid length 2): rows sum to 1, keys 2.. get 0
        values = [float(x) for x in row]
        assert values[2:] == [0.0] * 4 and abs(sum(values) - 1.0) < 0.011
    aligned = float(re.search(r"source digit for ([\d.]+)% of target tokens", text).group(1))
    assert aligned >= 90.0
    assert float(re.search(r"ViT test accuracy ([\d.]+)%", text).group(1)) >= 90.0
    # the demo ends with the second exercise on both models: which experiment predicts importance (rank
    # correlations), the curve cut and recovered, speed beside the bound, the kept model
    assert len(re.findall(r"rank correlation with the cost of cutting each head alone: \w+ -?[\d.]+", text)) == 2
    assert re.search(r"50% of heads pruned: digits reversed right [\d.]+% cut, [\d.]+% after 10 recovery steps", text)
    assert re.search(r"50% of heads pruned: test accuracy [\d.]+% cut, [\d.]+% after 10 recovery steps", text)
    assert len(re.findall(r"bound \(the arithmetic removed\): [\d.]+x / [\d.]+x / [\d.]+x at batch 1 / 16 / 64",
                          text)) == 2
    assert "| pruned 50% (multihead) |" in text and "kept: 50% of the heads pruned and recovered" in text
    for kind in ("toy", "vit"):
        for name in ("importance.png", "curve.png", "report.md", "methods.md", "methods.json"):
            assert (out / f"prune_{kind}" / name).stat().st_size > 200, (kind, name)
        report = json.loads((out / f"prune_{kind}" / "report.json").read_text())
        assert all("metric_recovered" in row for row in report["curve"])
        assert set(json.loads((out / f"prune_{kind}" / "methods.json").read_text())["methods"]) == {
            "gradient", "ablation", "entropy", "patching"}
    _the_demos_pruned_models_score_what_their_reports_say(out)
    for name in ("transformer_cross_attention.png", "transformer_encoder_rollout.png", "vit_heads.png",
                 "vit_rollout.png", "vit_explorer.html", "transformer_decoder_explorer.html"):
        assert (out / name).stat().st_size > 1000, name
        assert str(out / name) in text


def _the_demos_pruned_models_score_what_their_reports_say(out):
    """Each pruned + recovered model the demo writes loads with the documented call and scores its report's metric."""
    from multihead import heads
    from multihead.models import Seq2SeqConfig, Seq2SeqTransformer, ViT, ViTConfig, checkpoint, digits
    from multihead.models.seq2seq import digit_accuracy
    from multihead.models.vit import accuracy

    for kind, cls, cfg in (("toy", Seq2SeqTransformer, Seq2SeqConfig), ("vit", ViT, ViTConfig)):
        report = json.loads((out / f"prune_{kind}" / "report.json").read_text())
        model = checkpoint.load(cls, cfg, out / f"prune_{kind}" / "model")
        got = digit_accuracy(model) if kind == "toy" else accuracy(model, *digits()[2:])
        assert got == pytest.approx(report["final"]["metric"], abs=1e-9), kind
        unpruned = checkpoint.load(cls, cfg, out / "checkpoints" / ("transformer" if kind == "toy" else "vit"))

        def count(m):
            return sum(a.num_heads for a in heads.attention_modules(m).values())

        assert count(unpruned) - count(model) == report["final"]["heads_pruned"] > 0, kind


def test_viz_toy_and_vit(trained, tmp_path, capsys):
    assert main(["viz", "--model", "toy", "--text", "9071", "--out", str(tmp_path), "--checkpoints",
                 str(trained["dir"])]) == 0
    assert (tmp_path / "transformer_cross_attention.png").exists()
    assert main(["viz", "--model", "vit", "--index", "3", "--out", str(tmp_path), "--checkpoints",
                 str(trained["dir"])]) == 0
    assert (tmp_path / "vit_explorer.html").exists()
    capsys.readouterr()
    assert main(["viz", "--model", "toy", "--text", "abc", "--out", str(tmp_path), "--checkpoints",
                 str(trained["dir"])]) == 2
    err = capsys.readouterr().err
    assert "multihead viz: the toy model reverses strings of 3 to 10 digits 0-9" in err and "got 'abc'" in err
    assert "Traceback" not in err


def test_viz_minilm(tmp_path):
    pytest.importorskip("tokenizers")
    from multihead.models import minilm_path

    try:
        minilm_path()
    except FileNotFoundError:
        pytest.skip("the pretrained MiniLM package is not installed")
    assert main(["viz", "--model", "minilm", "--text", "Heads see different things.", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "minilm_heads.png").stat().st_size > 1000 and (tmp_path / "minilm_explorer.html").exists()


def test_format_weights_grid():
    s = format_weights(torch.tensor([[0.25, 0.75], [1.0, 0.0]]))
    assert s.splitlines()[1].split() == ["q0", "0.25", "0.75"]
    assert s.splitlines()[0].split() == ["k0", "k1"]


@pytest.mark.parametrize("argv, says", [
    (["prune", "--model", "toy", "--fraction", "1.5"], "--fraction: must be in (0, 1)"),
    (["prune", "--model", "toy", "--fraction", "-0.2"], "--fraction: must be in (0, 1)"),
    (["prune", "--model", "toy", "--fraction", "nan"], "--fraction: must be in (0, 1)"),
    (["prune", "--model", "toy", "--step", "0"], "--step: must be in (0, 1)"),
    (["prune", "--model", "toy", "--fraction", "0.2", "--step", "0.3"], "must not exceed --fraction"),
    (["prune", "--hf", "x", "--corpus", "/nonexistent.txt"], "--corpus /nonexistent.txt does not exist"),
    (["prune", "--model", "toy", "--recover", "-1"], "--recover: must be >= 0"),
    (["prune", "--model", "toy", "--no-runtime-files"],
     "multihead prune: --no-runtime-files applies to transformers checkpoints: give --hf DIR"),
    (["prune", "--model", "toy", "--recover", "-5"], "--recover: must be >= 0"),
    (["demo", "--recover", "-5"], "--recover: must be >= 0"),
    (["prune", "--model", "toy", "--passages", "-1"], "--passages: must be >= 0"),
    (["prune", "--model", "toy", "--passages", "many"], "--passages: must be an integer >= 0; got 'many'"),
    (["prune", "--model", "toy", "--time-budget", "5 minutes"],
     "--time-budget: must be a duration: seconds (300) or 300s, 5m, 1h30m; got '5 minutes'"),
    (["prune", "--model", "toy", "--time-budget", "0m"], "--time-budget: must be longer than 0 s; got '0m'"),
    (["viz", "--model", "vit", "--index", "-1"], "--index: must be >= 0"),
    (["viz", "--model", "vit", "--index", "99999"], "--index must be in [0, "),
    (["viz", "--model", "toy", "--index", "3"], "--index picks a test image of --model vit"),
    # were drawn as '12' and as the first 10 digits, and an empty --text as the default's digits, without a word
    (["viz", "--model", "toy", "--text", "12a"], "got '12a' (it holds 'a')"),
    (["viz", "--model", "toy", "--text", "1234567890123"], "got '1234567890123' (it has 13 digits)"),
    (["viz", "--model", "toy", "--text", ""], "got '' (it has 0 digits)"),
    (["viz", "--hf", "/nonexistent"], "config.json does not exist"),
    (["bench", "--workloads", "W9"], "unknown workload W9; valid: W1, W2, W3, W4, W5, W6, W7"),
    (["bench", "--reps", "0"], "--reps: must be > 0"),
    (["check", "x.py:M", "--timeout", "0"], "--timeout: must be > 0"),
])
def test_every_bad_value_is_one_line_and_exit_2_before_any_work(argv, says, tmp_path, capsys):
    argv = argv + (["--out", str(tmp_path / "o")] if argv[0] in ("prune", "viz") else [])
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusal: usage line + one error line, exit 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "checkpoints").exists()  # nothing trained


def test_help_answers_without_importing_torch_and_shows_examples():
    """`multihead --help` and each subcommand's help parse without torch (the slow import), with
    examples and defaults."""
    import subprocess
    import sys

    code = ("import sys, multihead_cli\n"
            "for argv in (['--help'], ['demo', '--help'], ['viz', '--help'], ['prune', '--help'], ['check', '--help'],"
            " ['bench', '--help']):\n"
            "    try:\n        multihead_cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TORCH False" in r.stdout
    assert "multihead prune --model toy --fraction 0.4" in r.stdout and "(default: 0.4)" in r.stdout
    assert "exit 0 OK, 1 not OK, 2 cannot be graded" in r.stdout


def test_viz_and_prune_find_the_demos_checkpoints(trained, tmp_path, monkeypatch, capsys):
    from multihead.apps.common import checkpoints

    demo_ckpts = tmp_path / "demo_out" / "checkpoints"
    shutil.copytree(trained["dir"], demo_ckpts)
    monkeypatch.setattr(checkpoints, "DEMO_CHECKPOINTS", demo_ckpts)
    assert checkpoints.checkpoints(None, tmp_path / "elsewhere") == demo_ckpts  # found, not retrained
    assert checkpoints.checkpoints(str(tmp_path / "mine"), tmp_path / "elsewhere") == tmp_path / "mine"
    assert main(["viz", "--model", "toy", "--text", "123", "--out", str(tmp_path / "v")]) == 0
    assert f"transformer: loaded {demo_ckpts / 'transformer'}" in capsys.readouterr().out
    assert not (tmp_path / "v" / "checkpoints").exists()


def test_durations_the_time_budget_takes():
    from multihead_cli import _duration

    assert [_duration(t) for t in ("300", "300s", "5m", "4.5m", "1h", "2m30s", "1h30m", " 90S ")] == \
        [300, 300, 300, 270, 3600, 150, 5400, 90]
