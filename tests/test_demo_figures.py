"""What the README and docs/explanation/demo.md promise of `make demo`'s figures: on one machine, with the same seed,
a second run prints the same accuracies, curves and correlations (training and cutting are seeded); the speed
figures are measured anew. The demo's own code, twice, at its smallest settings: both models trained for a few
steps; then its second exercise (``demo.prune_both``'s calls: the methods ranked, the curve cut and recovered, the
speed table) on the ViT's checkpoint."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")


def _trained_twice(train):
    a, b = train(), train()
    return a, b


def test_the_demos_training_gives_the_same_models_twice():
    from multihead.models.seq2seq import digit_accuracy, train_reverser
    from multihead.models.vit import train_vit

    for first, second in (_trained_twice(lambda: train_reverser(steps=8, progress=False)),
                          _trained_twice(lambda: train_vit(epochs=1, progress=False)[0])):
        one, two = first.state_dict(), second.state_dict()
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    r1, r2 = train_reverser(steps=8, progress=False), train_reverser(steps=8, progress=False)
    assert digit_accuracy(r1, n=64) == digit_accuracy(r2, n=64)


def _run_the_cut(ckpt, folder) -> tuple[dict, dict]:
    """The demo's second exercise on its ViT (``demo.prune_both``'s ``pruning.run``, at the smallest settings): the
    curve cut and recovered, the kept model, the speed table. (The methods' ranking, ``methods.compare``, is left
    out: it cuts every head alone and is too slow to run twice here.)"""
    from multihead.apps.prune import pruning

    setup = pruning.vit_setup(ckpt)
    report = pruning.run(setup, folder, pruning.Options(0.5, step=0.5, max_seconds=0.05, recover=2, recover_curve=True,
                                                        progress=False, runtime_peers=False))
    return report


def test_the_demos_curve_is_the_same_twice_and_its_timings_measured_anew(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from multihead.models import checkpoint
    from multihead.models.vit import train_vit

    checkpoint.save(train_vit(epochs=1, progress=False)[0], tmp_path / "checkpoints" / "vit")
    r1, r2 = (_run_the_cut(tmp_path / "checkpoints" / "vit", tmp_path / f"run{i}") for i in (1, 2))
    # the curve (cut and recovered) and the kept model: the same figures
    curve = [(row["fraction"], row["metric"], row.get("metric_recovered")) for row in r1["curve"]]
    assert len(curve) == 2 and curve[1][2] is not None  # unpruned, half cut (and recovered)
    assert curve == [(row["fraction"], row["metric"], row.get("metric_recovered")) for row in r2["curve"]]
    assert r1["final"]["metric"] == r2["final"]["metric"] and r1.get("bound") == r2.get("bound")
    # the speed table: measured on each run (its figures are not promised to repeat)
    assert r1["speed"] and r1["speed"].keys() == r2["speed"].keys()
    assert all(t["median_ms"] > 0 for v in r2["speed"].values() for t in v.values())
