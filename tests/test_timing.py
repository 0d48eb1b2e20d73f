"""multihead.timing: every round's time is kept, and ``paired`` reads a speed-up round by round, so a machine
whose speed drifts between rounds does not widen it."""

from __future__ import annotations

import pytest

from multihead import timing


class _Clock:
    """A fake ``perf_counter``: each call advances it by its cost times the machine's slowness in that round (the
    rounds' slownesses in order; two candidates, so a round is two calls)."""

    def __init__(self, slowness: list[float]):
        self.now, self.slowness, self.calls = 0.0, slowness, 0

    def __call__(self):
        return self.now

    def call(self, cost: float):
        def run():
            self.now += cost * self.slowness[self.calls // 2]
            self.calls += 1
        return run


def test_paired_cancels_a_drift_between_rounds(monkeypatch):
    clock = _Clock([1.0, 1.0, 3.0, 3.0, 3.0])  # the machine slows down after two rounds and stays slow
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    t = timing.interleaved({"peer": clock.call(2e-3), "pruned": clock.call(1e-3)}, warmup=0, min_rounds=5,
                           max_rounds=5)
    assert t["peer"].samples == pytest.approx((2.0, 2.0, 6.0, 6.0, 6.0))  # ms, every round in order
    assert t["pruned"].n == 5 and t["pruned"].samples == pytest.approx((1.0, 1.0, 3.0, 3.0, 3.0))
    # The pruned file runs in half the peer's time in every round: 2x, with no width
    assert timing.paired(t["peer"], t["pruned"]) == pytest.approx((2.0, 2.0, 2.0))
    # where the range read from the extremes of each side spans 0.67x-6x
    assert (t["peer"].min / t["pruned"].max, t["peer"].max / t["pruned"].min) == pytest.approx((2 / 3, 6.0))


def test_timings_of_different_calls_are_refused_and_scaling_keeps_the_rounds():
    one = timing.interleaved({"a": lambda: None}, warmup=0, min_rounds=2, max_rounds=2)["a"]
    other = timing.interleaved({"a": lambda: None}, warmup=0, min_rounds=3, max_rounds=3)["a"]
    with pytest.raises(ValueError, match=r"same rounds' times, got 2 and 3 rounds; time both in one interleaved"):
        timing.paired(one, other)
    assert one.scaled(0.5).samples == tuple(x * 0.5 for x in one.samples)
