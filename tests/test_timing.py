"""multihead.apps.timing: candidates given as parts are interleaved batch by batch, each round's time is kept, and
``paired`` reads the speed-up round by round, so a machine whose speed drifts between rounds does not widen it."""

from __future__ import annotations

import pytest

from multihead.apps import timing


class _Clock:
    """A fake ``perf_counter``: each part advances it by its cost times the machine's slowness in that round."""

    def __init__(self):
        self.now, self.slowness, self.log = 0.0, 1.0, []

    def __call__(self):
        return self.now

    def part(self, name: str, j: int, cost: float):
        def run():
            self.log.append((name, j))
            self.now += cost * self.slowness
        return run


def test_parts_run_batch_by_batch_in_a_rotating_order_and_every_round_is_kept(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    calls = {n: [clock.part(n, j, 1e-3) for j in range(3)] for n in ("a", "b")}
    t = timing.interleaved(calls, warmup=0, min_rounds=2, max_rounds=2)
    # round 0: part 0 a then b, part 1 b then a, part 2 a then b; round 1 starts one further on
    assert clock.log == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2),
                         ("b", 0), ("a", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert t["a"].samples == pytest.approx((3.0, 3.0)) and t["a"].n == 2  # ms: three parts of 1 ms


def test_paired_cancels_a_drift_between_rounds(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    slowness = iter([1.0, 1.0, 3.0, 3.0, 3.0])  # the machine slows down after two rounds and stays slow

    def next_round():
        clock.slowness = next(slowness)

    calls = {"peer": [next_round, clock.part("peer", 1, 2e-3)], "pruned": [lambda: None, clock.part("pruned", 1, 1e-3)]}
    t = timing.interleaved(calls, warmup=0, min_rounds=5, max_rounds=5)
    # The pruned file runs in half the peer's time in every round
    assert timing.paired(t["peer"], t["pruned"]) == pytest.approx((2.0, 2.0, 2.0))
    # where the range read from the extremes of each side spans 0.67x-6x
    assert (t["peer"].min / t["pruned"].max, t["peer"].max / t["pruned"].min) == pytest.approx((2 / 3, 6.0))


def test_unequal_parts_and_unpaired_timings_are_refused():
    with pytest.raises(ValueError, match=r"same number of parts .*\{'a': 2, 'b': 1\}.*same batches"):
        timing.interleaved({"a": [lambda: None] * 2, "b": [lambda: None]}, warmup=0)
    one = timing.interleaved({"a": lambda: None}, warmup=0, min_rounds=2, max_rounds=2)["a"]
    other = timing.interleaved({"a": lambda: None}, warmup=0, min_rounds=3, max_rounds=3)["a"]
    with pytest.raises(ValueError, match=r"same rounds' times, got 2 and 3 rounds; time both in one interleaved"):
        timing.paired(one, other)
    assert one.scaled(0.5).samples == tuple(x * 0.5 for x in one.samples)
