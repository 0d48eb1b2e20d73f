"""The project's one progress bar (multihead.extras.progress): tqdm's on a terminal; in a file, a pipe or a CI log,
whole lines now and then, never a carriage return -- the training bars and the speed table's alike."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from multihead.extras import progress

pytest.importorskip("tqdm")

# the ViT's training bar and the speed table's bar, as `make demo` draws them, with a line every 0.2 s
SCRIPT = """
import time
import multihead.extras
from multihead.timing import interleaved
from multihead.models import ViTConfig, train_vit

multihead.extras.LOG_EVERY = 0.2
train_vit(epochs=3, cfg=ViTConfig(d_model=16, heads=2, ffn=32, layers=1))
interleaved({"a": lambda: time.sleep(0.02), "b": lambda: time.sleep(0.02)}, max_seconds=1.0, min_rounds=30,
            max_rounds=30, progress="speed table, batch 1")
"""


def test_a_log_gets_whole_lines_and_no_carriage_return():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)  # pipes
    assert run.returncode == 0, run.stderr[-2000:]
    log = run.stderr
    assert "\r" not in log and log.endswith("\n")
    lines = log.splitlines()
    vit = [ln for ln in lines if ln.startswith("ViT (8x8 digits):")]
    speed = [ln for ln in lines if ln.startswith("speed table, batch 1:")]
    assert vit and len(speed) >= 3, log  # occasional lines while it runs, one at the end
    assert len(vit) + len(speed) == len(lines), log  # nothing else, no line run into another
    assert re.fullmatch(r"ViT \(8x8 digits\): 100%\|#+\| 3/3 \[.*loss=[\d.]+\]", vit[-1]), vit[-1]
    for ln in speed:
        assert re.fullmatch(r"speed table, batch 1: [# \d]*\d+/1 s allowed, round \d+", ln), ln


def test_on_a_terminal_it_is_tqdms_bar():
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = progress(range(3), desc="training", file=term)
    assert isinstance(bar, tqdm) and list(bar) == [0, 1, 2]
    assert "\r" in term.getvalue()  # redrawn in place, as a terminal wants


def test_in_a_file_the_lines_follow_the_work():
    f = io.StringIO()
    bar = progress(total=4, desc="recovery", file=f, every=1e-9)
    for _ in range(4):
        bar.update(1)
    bar.set_postfix_str("2 of 4 steps fit the time budget")
    bar.close()
    bar.close()  # closing twice writes nothing more
    lines = f.getvalue().splitlines()
    assert [re.search(r"\| (\d)/4", ln).group(1) for ln in lines[:4]] == ["1", "2", "3", "4"]
    assert lines[-1].endswith("2 of 4 steps fit the time budget]") and len(lines) == 5  # the end said once
    quiet = io.StringIO()
    assert list(progress(range(2), desc="off", file=quiet, enabled=False)) == [0, 1] and quiet.getvalue() == ""


@pytest.mark.parametrize("kw,error,words", [
    ({"desc": ""}, TypeError, "desc must be a non-empty str"),
    ({"desc": "x", "every": 0}, ValueError, "every must be a positive number of seconds (e.g. 10.0), got 0"),
    ({"desc": "x", "every": "5"}, TypeError, "every must be a number of seconds (e.g. 10.0), got str"),
])
def test_bad_arguments_are_refused_by_name(kw, error, words):
    with pytest.raises(error) as e:
        progress(range(2), **kw)
    assert words in str(e.value)
