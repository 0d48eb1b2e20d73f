"""tests/worksteal_order.py: the order `make test` hands the tests to xdist's worksteal workers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worksteal_order import SLOW, matches, shares, slow_first

ROOT = Path(__file__).resolve().parent.parent


class _Node:
    """A worker as xdist's scheduler sees it: the test indices it is sent."""

    shutting_down = False

    def __init__(self, k: int):
        from types import SimpleNamespace

        self.gateway = SimpleNamespace(id=f"gw{k}")
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent += indices


def _first_shares(ids: list[str], workers: int) -> list[list[str]]:
    """The tests xdist's own worksteal scheduler first sends each of ``workers`` workers of the collection ``ids``."""
    from types import SimpleNamespace

    from xdist.scheduler.worksteal import WorkStealingScheduling

    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = WorkStealingScheduling(config)
    nodes = [_Node(k) for k in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    return [[ids[i] for i in node.sent] for node in nodes]


@pytest.mark.parametrize("n, workers", [(1385, 3), (10, 3), (7, 2), (5, 1)])
def test_the_shares_are_the_ones_xdist_first_sends(n, workers):
    ids = [f"t{i}" for i in range(n)]
    got = _first_shares(ids, workers)
    sizes = shares(n, workers)
    assert [len(s) for s in got] == sizes and sum(got, []) == ids  # contiguous, in order, of these sizes


def test_each_worker_begins_with_its_part_of_the_slow_units_longest_first():
    ids = [f"tests/test_a.py::test_{i}" for i in range(30)] + ["tests/test_b.py::test_x[1]", "tests/test_b.py::test_x[2]",
                                                              "tests/test_c.py::test_y", "tests/test_c.py::test_z"]
    slow = [(("tests/test_b.py::test_x",), 50.0), (("tests/test_c.py",), 40.0), (("tests/test_a.py::test_3",), 30.0),
            (("tests/test_a.py::test_5", "tests/test_a.py::test_7"), 20.0), (("tests/test_gone.py::test_q",), 99.0)]
    order = slow_first(ids, 3, slow, nodeid=lambda x: x)
    assert sorted(order) == sorted(ids)  # every test once
    first = _first_shares(order, 3)
    assert first[0][:2] == ["tests/test_b.py::test_x[1]", "tests/test_b.py::test_x[2]"]  # 50 s: the first share
    assert first[1][:2] == ["tests/test_c.py::test_y", "tests/test_c.py::test_z"]  # 40 s: the next (a file, together)
    assert first[2][:3] == ["tests/test_a.py::test_3", "tests/test_a.py::test_5", "tests/test_a.py::test_7"]  # 30 + 20
    rest = [x for x in order if x not in ("tests/test_a.py::test_3", "tests/test_a.py::test_5",
                                          "tests/test_a.py::test_7") and x.startswith("tests/test_a.py")]
    assert rest == [x for x in ids if x in rest]  # the others keep their collected order
    assert slow_first(ids, 1, slow, nodeid=lambda x: x)[:2] == ["tests/test_b.py::test_x[1]", "tests/test_b.py::test_x[2]"]
    with pytest.raises(ValueError, match="slow_first: workers must be >= 1; got 0"):
        slow_first(ids, 0, slow, nodeid=lambda x: x)


def test_a_prefix_names_a_test_its_parametrisations_or_a_file_and_nothing_longer():
    assert matches("tests/test_a.py::test_x[1]", "tests/test_a.py::test_x")
    assert matches("tests/test_a.py::test_x", "tests/test_a.py::test_x")
    assert matches("tests/test_a.py::test_x", "tests/test_a.py")
    assert not matches("tests/test_a.py::test_xy", "tests/test_a.py::test_x")
    assert not matches("tests/test_ab.py::test_x", "tests/test_a.py")


def test_every_slow_entry_names_a_test_that_exists():
    """A renamed test would silently lose its place at the front: each entry's file exists and defines the test."""
    for prefixes, seconds in SLOW:
        assert seconds > 0
        for prefix in prefixes:
            path, _, test = prefix.partition("::")
            source = (ROOT / path).read_text()
            name = re.sub(r"\[.*$", "", test)
            assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.M), prefix
            page, _, heading = test.partition("[")[2].rstrip("]").partition(".md: ")
            if heading:  # a block of a documentation page (tests/test_readme.py): the page holds the heading
                assert re.search(rf"^#+ {re.escape(heading)}$", (ROOT / f"{page}.md").read_text(), re.M), prefix
